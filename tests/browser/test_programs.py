"""Programs as users, as the README shows them: its curl flow (a key made with a session, a task
submitted and read with the key) and its Python webhook receiver (the Standard Webhooks library
from PyPI, not zhihui's code) run as written against the real stack: the receiver verifies a
real delivery of the task's end, and refuses one signed with another secret."""

import json
import os
import queue
import re
import secrets
import socket
import subprocess
import sys
import threading

from conftest import ROOT, WAIT_S, free_port, wait_until


def block(name, language):
    readme = (ROOT / "README.md").read_text()
    match = re.search(
        rf"<!-- {name}:begin -->\n```{language}\n(.*?)```\n<!-- {name}:end -->", readme, re.S
    )
    assert match, f"README.md has no {name} block"
    return match.group(1)


def user(stack, name):
    status, body = stack.api("POST", "/api/v1/auth/register", body={"username": name, "password": "correct horse"})
    assert status == 201, body
    admin = stack.token("boss", "boss password")
    status, _ = stack.api("POST", f"/api/v1/admin/accounts/{body['id']}/grants", admin,
                          {"amount": "20", "reason": "开发者体验积分"})
    assert status == 201
    return stack.token(name, "correct horse")


class Receiver:
    """The README's receiver, started as written, with `secret`, on `port`."""

    def __init__(self, secret, port):
        self.script = ROOT / "target" / f"readme-receiver-{secrets.token_hex(4)}.py"
        self.script.write_text(block("webhook-receiver-python", "python"))
        self.process = subprocess.Popen(
            [sys.executable, str(self.script)],
            env=dict(os.environ, ZHIHUI_WEBHOOK_SECRET=secret, PORT=str(port)),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: self._listening(port), "the receiver to listen")

    def _read(self):
        for line in self.process.stdout:
            self.lines.put(line)

    @staticmethod
    def _listening(port):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    def next_line(self, timeout=WAIT_S):
        return self.lines.get(timeout=timeout)

    def stop(self):
        self.process.kill()
        self.process.wait()
        self.script.unlink()


def test_the_readme_program_flow_runs_with_a_key(stack):
    token = user(stack, f"shop{secrets.token_hex(3)}")
    done = subprocess.run(
        ["bash", "-c", block("program-flow", "sh")],
        env=dict(os.environ, BASE=stack.base, TOKEN=token),
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["status"] in ("queued", "dispatched", "running", "succeeded"), shown
    # The key is listed by name, never shown again.
    status, keys = stack.api("GET", "/api/v1/me/keys", token)
    assert status == 200 and keys[0]["name"] == "商品图后台"
    assert "key" not in keys[0]
    # The person sees the task the key submitted as their own.
    # (The list is the read model's, a projection's batch behind the submit.)
    listed = lambda: [task["task_id"] for task in stack.api("GET", "/api/v1/tasks", token)[1]["tasks"]]
    wait_until(lambda: listed(), "the task listed")
    assert listed()[0] == shown["task_id"]


def test_the_readme_python_receiver_verifies_a_real_delivery(stack):
    token = user(stack, f"bot{secrets.token_hex(3)}")
    port = free_port()
    ends = ["task.cancelled", "task.succeeded"]
    # Registered first (the secret is shown once), then the receiver starts with it.
    status, endpoint = stack.api("POST", "/api/v1/me/webhooks", token, {
        "url": f"http://127.0.0.1:{port}/zhihui", "event_types": ends,
    })
    assert status == 201, endpoint
    receiver = Receiver(endpoint["secret"], port)
    try:
        status, task = stack.api("POST", "/api/v1/tasks", token, {"prompt": "月光下的古镇，水墨风格", "steps": 2})
        assert status == 201, task
        # It ends one way or the other (cancelled while it waits, or it ran first): either end
        # is delivered.
        stack.api("POST", f"/api/v1/tasks/{task['task_id']}/cancel", token)
        line = receiver.next_line()
        message_id, kind, data = line.rstrip("\n").split(" ", 2)
        data = json.loads(data)
        assert kind in ends, line
        assert data["task_id"] == task["task_id"]
        assert data["prompt"] == "月光下的古镇，水墨风格"

        def delivered():
            status, log = stack.api("GET", f"/api/v1/me/webhooks/{endpoint['endpoint_id']}/deliveries", token)
            return status == 200 and log and log[0]["status"] == "delivered" and log
        log = wait_until(delivered, "the delivery logged")
        assert log[0]["message_id"] == message_id
        assert log[0]["attempts"][-1]["status"] == 204
    finally:
        receiver.stop()

    # The same receiver holding another endpoint's secret refuses (400): the log says so, and
    # the message waits for a retry.
    stack.api("DELETE", f"/api/v1/me/webhooks/{endpoint['endpoint_id']}", token)
    status, other = stack.api("POST", "/api/v1/me/webhooks", token, {
        "url": f"http://127.0.0.1:{port}/zhihui", "event_types": ends,
    })
    assert status == 201
    wrong = Receiver(endpoint["secret"], port)
    try:
        status, task = stack.api("POST", "/api/v1/tasks", token, {"prompt": "一盏灯笼", "steps": 2})
        assert status == 201
        stack.api("POST", f"/api/v1/tasks/{task['task_id']}/cancel", token)

        def refused():
            status, log = stack.api("GET", f"/api/v1/me/webhooks/{other['endpoint_id']}/deliveries", token)
            return status == 200 and log and log[0]["attempts"] and log
        log = wait_until(refused, "an attempt at the endpoint with the other secret")
        assert log[0]["attempts"][0]["status"] == 400
        assert log[0]["status"] == "pending", "a refused delivery is tried again later"
        assert wrong.lines.empty()
    finally:
        wrong.stop()
