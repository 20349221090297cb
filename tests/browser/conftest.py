"""The browser tests' stack: a real `zhihui serve` (the debug binary cargo built) on a fresh
database and Redis prefix, two ComfyUI simulators, an admin made with the CLI, and Debian's
Chromium driven by Playwright. Translation is on with no Ollama listening, as on a new machine.

Environment: DATABASE_URL and REDIS_URL (scripts/services.sh), ZHIHUI_BIN and SIM_BIN (default:
target/debug), SCREENSHOTS (default: docs/screenshots).
"""

import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[2]
ZHIHUI_BIN = os.environ.get("ZHIHUI_BIN", str(ROOT / "target/debug/zhihui"))
SIM_BIN = os.environ.get("SIM_BIN", str(ROOT / "target/debug/comfyui-sim"))
DATABASE_URL = os.environ.get("DATABASE_URL", "postgres://zhihui@127.0.0.1:55432/zhihui")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:56379/0")
SCREENSHOTS = Path(os.environ.get("SCREENSHOTS", str(ROOT / "docs/screenshots")))


def shot(page, name):
    """A whole-page screenshot under SCREENSHOTS, to be looked at."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # From the top: a page scrolled down draws its sticky header mid-page in a whole-page shot.
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
MODELS = "majicmixRealistic_v7.safetensors,anythingelseV4_v45.safetensors"
ADMIN = ("boss", "boss password")
# Each simulated sampling step takes this long: a task of 8 steps runs for over a second, long
# enough to watch its progress and to cancel what waits behind it.
STEP_DELAY_MS = 150
WAIT_S = 60


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def database_url(name):
    parts = urllib.parse.urlsplit(DATABASE_URL)
    return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))


def wait_until(check, what, timeout=WAIT_S):
    started = time.monotonic()
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() - started > timeout:
            raise AssertionError(f"waited {timeout}s for {what}")
        time.sleep(0.05)


class Stack:
    """The running services and what the tests need to reach them."""

    def __init__(self):
        self.directory = Path(tempfile.mkdtemp(prefix="zhihui-browser-"))
        self.database = f"zhihui_test_browser_{secrets.token_hex(6)}"
        subprocess.run(
            ["psql", DATABASE_URL, "-qc", f"CREATE DATABASE {self.database}"], check=True
        )
        self.processes = []
        self.sims = []
        for index in range(2):
            port = free_port()
            self.sims.append(f"http://127.0.0.1:{port}")
            self.processes.append(
                subprocess.Popen(
                    [SIM_BIN, "--listen", "127.0.0.1", "--port", str(port),
                     "--output-directory", str(self.directory / f"sim-{index}"),
                     "--models", MODELS, "--step-delay-ms", str(STEP_DELAY_MS)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = self.directory / "serve.log"
        self.env = dict(
            os.environ,
            ZHIHUI_DATABASE__URL=database_url(self.database),
            ZHIHUI_REDIS__URL=REDIS_URL,
            ZHIHUI_REDIS__KEY_PREFIX=f"browser:{self.database}",
            ZHIHUI_HTTP__PORT=str(self.port),
            ZHIHUI_DISPATCH__BACKENDS=",".join(
                f"gpu-{index} {url} 1" for index, url in enumerate(self.sims)
            ),
            ZHIHUI_DISPATCH__IMAGES_DIRECTORY=str(self.directory / "images"),
            ZHIHUI_DISPATCH__PROGRESS_NOTIFY_INTERVAL_MS="0",
            # Nothing staged ahead of a free server: a task waits in the queue, in its place,
            # until a server is free (the pages' queue places are what the tests watch).
            ZHIHUI_DISPATCH__STAGED_PER_BACKEND="0",
            ZHIHUI_DISPATCH__POSTED_AHEAD_PER_BACKEND="0",
            ZHIHUI_TRANSLATION__ENABLED="true",
            ZHIHUI_TRANSLATION__OLLAMA_URL="http://127.0.0.1:9",
            # Every browser comes from 127.0.0.1: the per-client limits are tested elsewhere.
            ZHIHUI_AUTH__LOGINS_PER_CLIENT_PER_MINUTE="1000000",
            ZHIHUI_AUTH__CODE_REQUESTS_PER_CLIENT_PER_HOUR="1000000",
            ZHIHUI_AUTH__CODE_SEND_INTERVAL_MS="1000",
            # The README's webhook receiver listens on loopback.
            ZHIHUI_WEBHOOKS__ALLOWED_NETWORKS="127.0.0.0/8",
            ZHIHUI_WEBHOOKS__PUBLIC_BASE_URL=f"http://127.0.0.1:{self.port}",
            ZHIHUI_LOG__FILTER="warn,zhihui::identity=info",
            ZHIHUI_LOG__FORMAT="json",
        )
        self.env.pop("RUST_LOG", None)
        self.log = open(self.log_path, "w")
        self.processes.append(
            subprocess.Popen([ZHIHUI_BIN, "serve"], env=self.env, stdout=self.log, stderr=self.log)
        )
        wait_until(self.ready, "zhihui serve to be ready")
        subprocess.run(
            [ZHIHUI_BIN, "users", "create", ADMIN[0], "--admin", "--password-stdin"],
            input=ADMIN[1] + "\n", text=True, env=self.env, check=True,
            stdout=subprocess.DEVNULL,
        )
        # The leader has seen both servers (and what they offer) before any test submits.
        wait_until(self.servers_up, "both image servers up")

    def ready(self):
        try:
            with urllib.request.urlopen(f"{self.base}/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, method, path, token=None, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base}{path}", data=data, method=method)
        request.add_header("content-type", "application/json")
        if token:
            request.add_header("authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                raw = response.read()
                return response.status, (json.loads(raw) if raw else None)
        except urllib.error.HTTPError as error:
            raw = error.read()
            return error.code, (json.loads(raw) if raw else None)

    def token(self, username, password):
        status, body = self.api("POST", "/api/v1/auth/login", body={"username": username, "password": password})
        assert status == 200, body
        return body["token"]

    def servers_up(self):
        status, servers = self.api("GET", "/api/v1/admin/backends", self.token(*ADMIN))
        return status == 200 and sum(1 for s in servers if s["state"] == "up" and s.get("models")) == 2

    def login_code(self, phone):
        """The code the development sender logged for `phone` (E.164), the newest."""
        codes = []
        for line in self.log_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("phone") == phone and entry.get("code"):
                codes.append(entry["code"])
        return codes[-1] if codes else None

    def cli(self, *args):
        return subprocess.run([ZHIHUI_BIN, *args], env=self.env, capture_output=True, text=True)

    def stop(self):
        for process in reversed(self.processes):
            process.kill()
            process.wait()
        self.log.close()
        subprocess.run(["psql", DATABASE_URL, "-qc", f"DROP DATABASE IF EXISTS {self.database} WITH (FORCE)"])


@pytest.fixture(scope="session")
def stack():
    running = Stack()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def browser():
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        yield launched
        launched.close()


class Person:
    """One browser context (its own cookies): a person at their own browser."""

    def __init__(self, browser, stack, lang="zh", viewport=(1366, 768), timezone=None):
        locale = "zh-CN" if lang == "zh" else "en-US"
        self.context = browser.new_context(
            locale=locale,
            timezone_id=timezone,
            viewport={"width": viewport[0], "height": viewport[1]},
            extra_http_headers={"Accept-Language": "zh-CN,zh;q=0.9" if lang == "zh" else "en-US,en;q=0.9"},
        )
        self.stack = stack
        self.page = self.context.new_page()
        self.problems = []
        self.page.on("console", lambda message: self._console(message))
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.dialogs = []

    def _console(self, message):
        # A Content-Security-Policy violation, a failed script: a page is broken.
        if message.type == "error" and "Failed to load resource" not in message.text:
            self.problems.append(message.text)

    def accept_dialogs(self):
        def accept(dialog):
            self.dialogs.append(dialog.message)
            dialog.accept()
        self.page.on("dialog", accept)

    def go(self, path, status=200):
        """Open a page; its answer (after redirects) must be `status`, so an error page is never
        taken for the page asked for."""
        response = self.page.goto(f"{self.stack.base}{path}")
        assert response is not None and response.status == status, (
            f"GET {path}: {response.status if response else 'no answer'}, not {status}"
        )
        return self.page

    def register(self, username, password="correct horse"):
        page = self.go("/register")
        page.fill("#username", username)
        page.fill("#password", password)
        page.click("button[type=submit]")
        page.wait_for_url("**/generate")
        return page

    def login(self, username, password):
        page = self.go("/login")
        page.fill("#username", username)
        page.fill("#password", password)
        page.locator("form", has=page.locator("#username")).locator("button[type=submit]").click()
        page.wait_for_url("**/generate")
        return page

    def close(self):
        assert not self.problems, f"the page reported: {self.problems}"
        self.context.close()


@pytest.fixture
def person(browser, stack):
    made = []

    def make(lang="zh", viewport=(1366, 768), timezone=None):
        one = Person(browser, stack, lang, viewport, timezone)
        made.append(one)
        return one

    yield make
    for one in made:
        one.close()


def unique(prefix):
    return f"{prefix}{secrets.token_hex(3)}"
