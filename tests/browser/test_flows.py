"""The web app as people use it, in a real Chromium: each test names the person and the goal."""

import re
import subprocess
import tempfile

from conftest import ADMIN, shot, unique, wait_until

CHINESE_PROMPT = "一只在雪地里奔跑的红狐狸，电影感光线"


def grant(admin, username, amount, reason):
    """The admin finds `username` and grants `amount` points with `reason`, in their browser."""
    page = admin.go("/admin/users")
    page.fill("#q", username)
    page.click("form.search button[type=submit]")
    page.wait_for_url(re.compile(r".*/admin/users/[0-9a-f-]{36}$"))
    page.fill("#amount", str(amount))
    page.fill("#reason", reason)
    page.click("#grant-title ~ form button[type=submit]")
    page.locator(".notice.success").wait_for()
    return page


def submit(page, prompt, steps=8, images=1, answer=None):
    """Submit the form; the new card (and, into `answer`, the HTML the server sent for it)."""
    page.fill("#prompt", prompt)
    page.fill("#steps", str(steps))
    page.select_option("#images", str(images))
    before = page.locator("#tasks article.task").count()
    with page.expect_response(lambda response: response.url.endswith("/generate") and response.request.method == "POST") as sent:
        page.click("#generate-form button[type=submit]")
    if answer is not None:
        answer.append(sent.value.text())
    wait_until(lambda: page.locator("#tasks article.task").count() > before, "the new task's card")
    return page.locator("#tasks article.task").first


def watch_progress(page):
    """Record every value the first card's progress bar takes, and every title, from now on."""
    page.evaluate(
        """() => {
            window.__progress = [];
            window.__titles = [];
            const record = () => {
                const bar = document.querySelector('#tasks article.task [data-field="progress"]');
                if (bar && !bar.closest('[hidden]')) {
                    const value = Number(bar.value);
                    if (window.__progress[window.__progress.length - 1] !== value) window.__progress.push(value);
                }
                if (window.__titles[window.__titles.length - 1] !== document.title) window.__titles.push(document.title);
            };
            new MutationObserver(record).observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
            new MutationObserver(record).observe(document.head, {subtree: true, childList: true, characterData: true});
        }"""
    )


def test_a_new_user_signs_up_and_makes_a_first_image_from_a_chinese_prompt(stack, person):
    user = person("zh")
    name = unique("xiaoming")
    page = user.register(name)
    assert page.locator("#balance .amount").inner_text() == "0.00"
    wait_until(lambda: page.evaluate("document.body.dataset.socket") == "open", "the live socket")

    # An admin, in a browser of their own, grants 10 points with a reason in Chinese; the
    # user's open page shows the new balance without a reload.
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 10, "新用户体验积分")
    page.locator("#balance .amount", has_text="10.00").wait_for()

    # The ledger names the movement and its reason.
    page = user.go("/points")
    assert page.locator("[data-testid=available]").inner_text() == "10.00"
    assert page.locator("table.ledger").get_by_text("新用户体验积分").is_visible()
    assert page.locator("table.ledger").get_by_text("管理员发放").is_visible()

    page = user.go("/generate")
    wait_until(lambda: page.evaluate("document.body.dataset.socket") == "open", "the live socket")
    watch_progress(page)
    # Both image servers busy with someone else's work: the new task has to wait its turn.
    occupy_both_servers(stack)
    answer = []
    card = submit(page, CHINESE_PROMPT, steps=8, answer=answer)
    assert card.locator(".prompt").inner_text() == CHINESE_PROMPT
    # Its place in the queue (as submitted), then its progress by steps, then its image.
    assert re.search(r"排队第 \d+ 位", answer[0]), answer[0]
    image = page.locator("#tasks article.task").first.locator(".images img")
    image.wait_for(timeout=60_000)
    wait_until(lambda: page.evaluate("(img) => img.complete && img.naturalWidth > 0", image.element_handle()), "the image to load")
    progress = page.evaluate("window.__progress")
    assert len([value for value in progress if value > 0]) >= 3, progress
    titles = page.evaluate("window.__titles")
    assert any(re.match(r"\d+% · ", title) for title in titles), titles
    assert not re.match(r"\d+% · ", page.title()), "the title shows progress only while it runs"

    # The image as served: labelled (the visible mark and the AIGC metadata).
    src = image.get_attribute("src")
    response = user.context.request.get(f"{stack.base}{src}")
    assert response.status == 200
    assert response.headers["x-aigc-label"] == "1"
    with tempfile.NamedTemporaryFile(suffix=".png") as file:
        file.write(response.body())
        file.flush()
        inspected = stack.cli("images", "inspect", file.name)
    assert "PNG tEXt AIGC: ReservedCode1 checks out" in inspected.stdout, inspected.stdout
    image.screenshot(path=str(stack_screenshot("first-image-with-mark.png")))

    # One point charged, nothing frozen.
    page.locator("#balance .amount", has_text="9.00").wait_for()
    task_id = card.get_attribute("data-task-id")
    page = user.go("/points")
    assert page.locator("[data-testid=frozen]").inner_text() == "0.00"
    # The charge names its task by the prompt and leads to that task's own page.
    link = page.locator("table.ledger a.task-link").first
    assert link.inner_text() == f"任务「{CHINESE_PROMPT[:16]}…」", link.inner_text()
    link.click()
    page.wait_for_url(f"**/tasks/{task_id}")
    assert page.locator(f"#task-{task_id} .prompt").inner_text() == CHINESE_PROMPT
    assert page.locator(f"#task-{task_id} .images img").count() == 1


def occupy_both_servers(stack, steps=12):
    """Another user's two tasks, one per server, each `steps` steps long."""
    admin = stack.token(*ADMIN)
    name = unique("mang")
    assert stack.api("POST", "/api/v1/auth/register", body={"username": name, "password": "correct horse"})[0] == 201
    token = stack.token(name, "correct horse")
    status, me = stack.api("GET", "/api/v1/me", token)
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "2", "reason": "busy"})[0] == 201
    for _ in range(2):
        status, body = stack.api("POST", "/api/v1/tasks", token, {"prompt": "a busy server", "steps": steps})
        assert status == 201, body

    def both_running():
        status, page = stack.api("GET", "/api/v1/tasks", token)
        return sum(1 for task in page["tasks"] if task["status"] == "running") == 2

    wait_until(both_running, "both servers running")


def stack_screenshot(name):
    from conftest import SCREENSHOTS
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS / name


def test_a_user_cancels_a_waiting_task_and_gets_the_points_back(stack, person):
    user = person("zh")
    name = unique("quxiao")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 6, "测试取消")
    page = user.go("/generate")
    user.accept_dialogs()
    # Three long tasks on two servers: the third waits in the queue.
    for _ in range(3):
        submit(page, "一座雪中的灯塔", steps=40, images=2)
    waiting = page.locator("#tasks article.task[data-status=queued]").first
    waiting.wait_for()
    task_id = waiting.get_attribute("data-task-id")
    page.locator("#balance .amount", has_text="0.00").wait_for()
    waiting.locator("button.danger").click()
    cancelled = page.locator(f"#task-{task_id}")
    cancelled.locator(".notice", has_text="已取消").wait_for()
    assert cancelled.get_attribute("data-status") == "cancelled"
    assert user.dialogs and "退还" in user.dialogs[-1]
    page.locator("#balance .amount", has_text="2.00").wait_for()
    # The running ones are cancelled too (interrupted on their servers): everything comes back.
    for running in page.locator("#tasks article.task").all():
        if running.get_attribute("data-status") in ("queued", "dispatched", "running"):
            button = running.locator("button.danger")
            if button.count():
                button.click()
    wait_until(lambda: user.go("/points").locator("[data-testid=frozen]").inner_text() == "0.00", "every hold released or settled")


def test_a_running_task_cancelled_while_its_answers_cross_ends_as_cancelled_with_the_points_back(stack, person):
    """Cancelling a running task sends two answers that can cross: the cancel button's own card
    (drawn while the task was still being stopped) and the card the socket's news asks for once
    it ended. Here the button's answer is held until the news has asked for its card, and that
    card is held until the button's has landed: the older card must not be the last word, and
    the header must show the points returned, all without a reload."""
    user = person("zh")
    name = unique("jiaocha")
    user.register(name)
    token = stack.token(name, "correct horse")
    me = stack.api("GET", "/api/v1/me", token)[1]
    admin = stack.token(*ADMIN)
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "5", "reason": "交叉测试"})[0] == 201
    page = user.go("/generate")
    user.accept_dialogs()
    page.locator("body[data-socket=open]").wait_for(state="attached")
    card = submit(page, "暴雨中的霓虹街道", steps=50, images=2)
    task_id = card.get_attribute("data-task-id")
    card = page.locator(f"#task-{task_id}")
    wait_until(lambda: page.locator(f"#task-{task_id}[data-status=running]").count() == 1, "the task running")
    page.locator("#balance .frozen").wait_for()

    held = {}

    def hold_cancel(route):
        held["cancel"] = (route, route.fetch())  # drawn now, while the task is being stopped

    def hold_first_card(route):
        if "card" in held:
            route.continue_()
        else:
            held["card"] = route

    page.route(f"**/tasks/{task_id}/cancel", hold_cancel)
    page.route(f"**/tasks/{task_id}/card", hold_first_card)
    card.locator("button.danger").click()
    wait_until(lambda: page.evaluate("1") and "cancel" in held and "card" in held, "both answers held")
    # Seen by an observer, not by polling: the older card may be drawn again at once.
    page.evaluate(
        """(id) => {
            window.__older = false;
            new MutationObserver(() => {
                const card = document.getElementById(`task-${id}`);
                if (card && card.textContent.includes('正在取消')) window.__older = true;
            }).observe(document.body, {subtree: true, childList: true, characterData: true});
        }""",
        task_id,
    )
    route, answer = held["cancel"]
    route.fulfill(response=answer)
    wait_until(lambda: page.evaluate("window.__older"), "the button's older card shown")
    held["card"].continue_()
    card.locator(".notice", has_text="已取消").wait_for()
    assert card.get_attribute("data-status") == "cancelled"
    page.locator("#balance .amount", has_text="5.00").wait_for()
    assert page.locator("#balance .frozen").count() == 0


def test_a_card_drawn_before_its_task_ended_catches_up_when_the_socket_opens(stack, person):
    """The history is drawn while a task waits; its socket cannot open until the task has ended
    (as on a train through a tunnel). Once it opens, the card shows the image and the publish
    button without a reload: nothing that happened before the socket opened is lost."""
    admin = stack.token(*ADMIN)
    user = person("zh")
    name = unique("suidao")
    user.register(name)
    token = stack.token(name, "correct horse")
    me = stack.api("GET", "/api/v1/me", token)[1]
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "2", "reason": "隧道测试"})[0] == 201
    occupy_both_servers(stack)
    status, task = stack.api("POST", "/api/v1/tasks", token, {"prompt": "隧道尽头的一束光", "steps": 4})
    assert status == 201, task
    # The history is the read model's: the task is on it before the page is drawn.
    wait_until(lambda: any(listed["task_id"] == task["task_id"] for listed in stack.api("GET", "/api/v1/tasks", token)[1]["tasks"]), "the task listed")

    page = user.page
    page.route("**/api/v1/ws/ticket", lambda route: route.abort())
    page = user.go("/history")
    card = page.locator(f"#task-{task['task_id']}")
    assert card.get_attribute("data-status") in ("submitted", "queued"), card.get_attribute("data-status")
    wait_until(lambda: stack.api("GET", f"/api/v1/tasks/{task['task_id']}", token)[1]["status"] == "succeeded", "the image")
    assert page.locator("body[data-socket=open]").count() == 0
    assert card.get_attribute("data-status") in ("submitted", "queued")

    page.unroute("**/api/v1/ws/ticket")
    page.locator("body[data-socket=open]").wait_for(state="attached", timeout=40_000)
    card.locator(".images img").wait_for()
    assert card.get_attribute("data-status") == "succeeded"
    assert card.get_by_role("link", name="发布到画廊").is_visible()


def test_a_task_submitted_elsewhere_appears_on_the_open_pages_without_a_reload(stack, person):
    """A person with the generate page and the history open in two tabs, and a program of theirs
    submitting through an API key: the program's task shows up on top of both lists (the empty
    state gone) and runs to its image there; a task submitted from the page is on it once."""
    admin = stack.token(*ADMIN)
    user = person("zh")
    name = unique("liangge")
    user.register(name)
    token = stack.token(name, "correct horse")
    me = stack.api("GET", "/api/v1/me", token)[1]
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "5", "reason": "两个标签页"})[0] == 201
    status, key = stack.api("POST", "/api/v1/me/keys", token, {"name": "我的脚本", "scopes": ["tasks:write", "tasks:read"]})
    assert status == 201, key
    generate = user.go("/generate")
    assert generate.locator("p.empty").is_visible()
    history = user.context.new_page()
    history.goto(f"{stack.base}/history")
    for tab in (generate, history):
        tab.locator("body[data-socket=open]").wait_for(state="attached")

    status, task = stack.api("POST", "/api/v1/tasks", key["key"], {"prompt": "脚本画的一座雪山", "steps": 4})
    assert status == 201, task
    for tab, list_of in ((generate, "#tasks"), (history, ".cards.history")):
        card = tab.locator(f"{list_of} > article.task").first
        wait_until(lambda: card.get_attribute("data-task-id") == task["task_id"], "the program's task on top")
        card.locator(".images img").wait_for(timeout=40_000)
        assert tab.locator(f"#task-{task['task_id']}").count() == 1
    assert generate.locator("p.empty").count() == 0
    shot(generate, "flow-task-from-elsewhere-zh-desktop")

    mine = submit(generate, "页面上画的一片竹林", steps=4)
    mine_id = mine.get_attribute("data-task-id")
    mine.locator(".images img").wait_for(timeout=40_000)
    assert generate.locator(f"#task-{mine_id}").count() == 1
    wait_until(lambda: history.locator(f"#task-{mine_id}").count() == 1, "the page's task in the other tab")
    history.close()

    # The program submits while the page's socket cannot open (a train in a tunnel): once it
    # opens, the task it was never told of is on top all the same, once.
    generate.route("**/api/v1/ws/ticket", lambda route: route.abort())
    generate.reload()
    status, late = stack.api("POST", "/api/v1/tasks", key["key"], {"prompt": "隧道里提交的一条河", "steps": 4})
    assert status == 201, late
    wait_until(lambda: stack.api("GET", "/api/v1/tasks?limit=1", token)[1]["tasks"][0]["task_id"] == late["task_id"], "the task listed")
    assert generate.locator("body[data-socket=open]").count() == 0
    assert generate.locator(f"#task-{late['task_id']}").count() == 0
    generate.unroute("**/api/v1/ws/ticket")
    generate.locator("body[data-socket=open]").wait_for(state="attached", timeout=40_000)
    top = generate.locator("#tasks > article.task").first
    wait_until(lambda: top.get_attribute("data-task-id") == late["task_id"], "the task from the tunnel on top")
    top.locator(".images img").wait_for(timeout=40_000)
    assert generate.locator(f"#task-{late['task_id']}").count() == 1
    assert generate.locator(f"#task-{mine_id}").count() == 1


def test_a_task_whose_server_dies_says_so_and_finishes_once_the_server_is_back(stack, person):
    """The server a person's task runs on is killed: the card says the server stopped answering
    (not a progress bar frozen without a word), and once the server is back the task runs again
    and ends with its image, without a reload."""
    admin = stack.token(*ADMIN)
    user = person("zh", (390, 844))
    name = unique("duandian")
    user.register(name)
    token = stack.token(name, "correct horse")
    me = stack.api("GET", "/api/v1/me", token)[1]
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "2", "reason": "断电测试"})[0] == 201
    page = user.go("/generate")
    page.locator("body[data-socket=open]").wait_for(state="attached")
    card = submit(page, "停电前的最后一幅画", steps=40)
    wait_until(lambda: card.get_attribute("data-server") is not None and card.get_attribute("data-status") == "running", "the task running on a server")
    server = card.get_attribute("data-server")
    index = int(server.removeprefix("gpu-"))
    crashed = stack.processes[index]
    crashed.kill()
    crashed.wait()
    line = card.locator("[data-field=server]")
    wait_until(lambda: "暂时联系不上" in line.inner_text(), "the card saying the server stopped answering")
    assert server in line.inner_text()
    shot(page, "flow-server-lost-zh-phone")
    stack.processes[index] = subprocess.Popen(crashed.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    card.locator(".images img").wait_for(timeout=90_000)
    assert card.get_attribute("data-status") == "succeeded"
    assert "暂时联系不上" not in card.inner_text()
    wait_until(stack.servers_up, "both image servers up again")


def test_a_check_in_a_redeemed_code_and_a_flash_sale_each_show_in_the_ledger(stack, person):
    user = person("zh")
    name = unique("qiandao")
    user.register(name)
    user.accept_dialogs()

    # Check in: the bonus and the calendar.
    page = user.go("/checkin")
    page.click("#checkin button[type=submit]")
    page.locator("#checkin .notice.success").wait_for()
    assert page.locator("#checkin td.checked").count() == 1
    assert "已连续签到 1 天" in page.locator("#checkin .streak").inner_text()

    # An admin issues a batch of codes; the user redeems one from its CSV.
    admin = person("zh")
    admin.login(*ADMIN)
    admin.accept_dialogs()
    codes = admin.go("/admin/codes")
    codes.fill("#count", "3")
    codes.fill("#points", "12.5")
    note = unique("浏览器测试批次")
    codes.fill("#note", note)
    codes.click("#new-batch ~ form button[type=submit]")
    # Other tests issue batches on the same server: find this one by its note.
    batch = codes.locator("#batches article.batch", has_text=note)
    batch.locator(".state-issued").wait_for()
    csv_url = batch.locator("a[download]").get_attribute("href")
    csv = admin.context.request.get(f"{stack.base}{csv_url}").text()
    code = csv.splitlines()[1].split(",")[1]
    page = user.go("/redeem")
    page.fill("#code", code)
    page.click("main form button[type=submit]")
    page.locator("#redeem-messages .notice.success").wait_for()
    assert "12.50" in page.locator("#redeem-messages").inner_text()
    # A mistyped code is refused with what to do, and nothing moves.
    page.fill("#code", code[:-1] + ("0" if code[-1] != "0" else "1"))
    page.click("main form button[type=submit]")
    page.locator("#redeem-messages .notice.error").wait_for()

    # An admin opens a flash sale; the user claims it and hears the result on the socket.
    promotions = admin.go("/admin/promotions")
    title = "限时抢购 " + unique("")
    promotions.fill("#title", title)
    promotions.fill("#promo-points", "30")
    promotions.fill("#stock", "5")
    promotions.click("#new-promotion ~ form button[type=submit]")
    promotions.locator("#promotions article.promotion", has_text=title).wait_for()
    # The sales list is the read model's: drawn again until it has the new sale.
    wait_until(lambda: user.go("/sales").locator("article.sale", has_text=title).count() == 1, "the new sale listed")
    page = user.page
    wait_until(lambda: page.evaluate("document.body.dataset.socket") == "open", "the live socket")
    sale = page.locator("article.sale", has_text=title)
    sale.locator("button.primary").click()
    page.locator("article.sale", has_text=title).locator(".notice.success").wait_for(timeout=30_000)

    ledger = user.go("/points").locator("table.ledger")
    for kind in ("签到奖励", "兑换码", "限时抢购"):
        assert ledger.get_by_text(kind).first.is_visible(), kind
    assert user.page.locator("[data-testid=available]").inner_text() == "47.50"


def test_a_user_cannot_open_an_admin_page_or_another_users_task(stack, person):
    owner = person("zh")
    owner_name = unique("zhuren")
    owner.register(owner_name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, owner_name, 1, "一张图")
    page = owner.go("/generate")
    card = submit(page, "一棵树", steps=2)
    task_id = card.get_attribute("data-task-id")
    image = page.locator(f"#task-{task_id} .images img")
    image.wait_for(timeout=60_000)
    image_url = image.get_attribute("src")

    other = person("zh")
    other.register(unique("pangren"))
    for path in ("/admin", "/admin/users", "/admin/servers", "/admin/codes", "/admin/promotions", "/admin/audit"):
        response = other.page.goto(f"{stack.base}{path}")
        assert response.status == 403, path
        assert "只对管理员开放" in other.page.inner_text("main")
        assert other.page.locator("nav.subnav").count() == 0
    # Nothing of the admin pages in a user's page or script.
    page = other.go("/generate")
    html = page.content()
    assert "/admin" not in html
    script = other.context.request.get(f"{stack.base}/assets/app.js").text()
    assert "admin" not in script.lower()
    # Another user's task and image: not found, as if they did not exist.
    assert other.context.request.get(f"{stack.base}/tasks/{task_id}/card").status == 404
    assert other.context.request.get(f"{stack.base}/tasks/{task_id}").status == 404
    assert other.context.request.get(f"{stack.base}{image_url}").status == 404
    assert other.context.request.get(f"{stack.base}/api/v1/tasks/{task_id}").status == 404


def test_a_prompt_that_looks_like_markup_shows_as_the_characters_typed(stack, person):
    user = person("zh")
    name = unique("xss")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 2, "转义测试")
    dialogs = []
    user.page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    hostile = '<img src=x onerror=alert(1)>"\'</textarea><script>alert(2)</script>'
    page = user.go("/generate")
    card = submit(page, hostile, steps=2)
    assert card.locator(".prompt").inner_text() == hostile
    assert page.locator("#tasks img[src=x]").count() == 0
    card_id = card.get_attribute("data-task-id")
    page.locator(f"#task-{card_id} .images img").wait_for(timeout=60_000)
    # Every page that shows the prompt: the card again, history, "again" in the form.
    for path in ("/generate", "/history", f"/generate?again={card_id}"):
        page = user.go(path)
        assert page.locator("img[src=x]").count() == 0, path
        assert page.locator("script", has_text="alert(2)").count() == 0, path
    assert page.locator("#prompt").input_value() == hostile
    assert user.go("/history").locator(".prompt", has_text="<img src=x").first.inner_text() == hostile
    assert not dialogs, dialogs


def test_the_generate_flow_works_by_keyboard_alone(stack, person):
    user = person("zh")
    name = unique("jianpan")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 1, "键盘测试")
    page = user.go("/generate")
    # From the top of the page: the skip link, then into the form.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Enter")
    focused = None
    for _ in range(30):
        page.keyboard.press("Tab")
        focused = page.evaluate("document.activeElement.id")
        if focused == "prompt":
            break
    assert focused == "prompt"
    page.keyboard.type("一只猫，用键盘提交")
    # Through every field to the submit button, then Enter.
    for _ in range(30):
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.type === 'submit' && document.activeElement.closest('#generate-form') !== null"):
            break
    else:
        raise AssertionError("the submit button is not reachable by Tab")
    page.keyboard.press("Enter")
    page.locator("#tasks article.task .prompt", has_text="一只猫，用键盘提交").wait_for()


def test_a_user_logs_in_with_a_phone_code(stack, person):
    user = person("zh")
    page = user.go("/login")
    phone = "139" + str(int(unique("")[:6], 16) % 10**8).zfill(8)
    page.fill("#phone", phone)
    page.click("#with-code ~ form[action^='/login/code'] button")
    page.locator(".notice.info").wait_for()
    code = wait_until(lambda: stack.login_code(f"+86{phone}"), "the logged code")
    page.fill("#code", code)
    page.locator("form", has=page.locator("#code")).locator("button[type=submit]").click()
    page.wait_for_url("**/generate")
    assert page.locator(".who .name").inner_text().startswith("+86139")


def send_code_waiting_out_the_interval(page, button):
    """Press a page's send-code button. A code sent to the same phone moments before (within the
    send interval, a second here) is refused as too soon: the button counts down, and is pressed
    again once free."""
    button.click()
    page.locator(".notice").first.wait_for()
    if page.locator(".notice.error").count():
        assert "验证码发送太频繁" in page.locator(".notice.error").inner_text()
        resend = page.get_by_role("button", name="重新发送", exact=True)
        resend.wait_for()
        wait_until(resend.is_enabled, "the send button free once the wait is over")
        resend.click()
    page.locator(".notice.info", has_text="验证码已发送").wait_for()


def test_a_user_binds_a_phone_on_the_settings_page_and_then_logs_in_with_a_code(stack, person):
    """A user who signed up with a username binds a phone on a phone's screen: the send button
    counts down to the next send and is free again after it; a wrong code is said in the card;
    the right one binds the phone, which then logs the user in."""
    user = person("zh", (390, 844))
    name = unique("bangding")
    user.register(name)
    page = user.go("/settings")
    phone = "137" + str(int(unique("")[:6], 16) % 10**8).zfill(8)
    card = page.locator("#phone-card")
    assert card.locator("#bind-code").is_disabled()
    page.fill("#bind-phone", phone)
    card.get_by_role("button", name="发送验证码").click()
    card.locator(".notice.info", has_text="验证码已发送").wait_for()
    # The wait counts down on the button, then it may be pressed again.
    assert card.locator("button[data-wait]").count() == 1
    resend = card.get_by_role("button", name="重新发送", exact=True)
    resend.wait_for()
    wait_until(resend.is_enabled, "the send button free once the wait is over")
    code = wait_until(lambda: stack.login_code(f"+86{phone}"), "the logged code")
    wrong = str((int(code[0]) + 1) % 10) + code[1:]
    page.fill("#bind-code", wrong)
    card.get_by_role("button", name="绑定").click()
    page.locator("#phone-card .notice.error", has_text="验证码不正确").wait_for()
    assert page.input_value("#bind-phone") == phone
    shot(page, "flow-settings-phone-wrong-code-zh-phone")
    page.fill("#bind-code", code)
    page.locator("#phone-card").get_by_role("button", name="绑定").click()
    page.wait_for_url("**/settings?phone_bound=1")
    page.locator(".notice.info", has_text=f"手机号 +86{phone} 已绑定").wait_for()
    assert page.locator("#phone-card").count() == 0
    shot(page, "flow-settings-phone-bound-zh-phone")

    other = person("zh")
    login = other.go("/login")
    login.fill("#phone", phone)
    send_code_waiting_out_the_interval(login, login.locator("#with-code ~ form[action^='/login/code'] button"))
    assert login.locator("form[action^='/login/code'] button[data-wait]").count() == 1
    code = wait_until(
        lambda: (fresh := stack.login_code(f"+86{phone}")) != code and fresh, "a second code"
    )
    login.fill("#code", code)
    login.locator("form", has=login.locator("#code")).locator("button[type=submit]").click()
    login.wait_for_url("**/generate")
    assert login.locator(".who .name").inner_text() == name


def test_a_forgotten_password_is_set_again_from_the_login_page_with_a_phone_code(stack, person):
    """From the login page's "forgot" link: a code to the bound phone, a too-short password
    refused by name with the phone kept, then the new password set and logging in with it."""
    name = unique("wangji")
    user = person("zh", (390, 844))
    user.register(name)
    phone = "136" + str(int(unique("")[:6], 16) % 10**8).zfill(8)
    token = stack.token(name, "correct horse")
    assert stack.api("POST", "/api/v1/auth/code", body={"phone": phone})[0] == 202
    code = wait_until(lambda: stack.login_code(f"+86{phone}"), "the binding code")
    status, body = stack.api("POST", "/api/v1/me/phone", token, {"phone": phone, "code": code})
    assert status == 200, body

    visitor = person("zh", (390, 844))
    page = visitor.go("/login")
    page.get_by_role("link", name="忘记密码？").click()
    page.wait_for_url("**/password-reset")
    assert page.locator("#code").is_disabled()
    page.fill("#phone", phone)
    send_code_waiting_out_the_interval(page, page.get_by_role("button", name="发送验证码"))
    code = wait_until(
        lambda: (fresh := stack.login_code(f"+86{phone}")) != code and fresh, "the reset code"
    )
    page.fill("#code", code)
    # The browser's own check is bypassed to show the server's answer to a short password.
    page.eval_on_selector("#new_password", "input => input.removeAttribute('minlength')")
    page.fill("#new_password", "short")
    page.get_by_role("button", name="设置新密码").click()
    page.locator(".notice.error", has_text="新密码").wait_for()
    assert page.input_value("#phone") == phone and page.input_value("#code") == code
    shot(page, "flow-password-reset-refused-zh-phone")
    page.fill("#new_password", "a brand new battery")
    page.get_by_role("button", name="设置新密码").click()
    page.wait_for_url("**/login?changed=1")
    page.locator(".notice.info", has_text="密码已修改").wait_for()
    visitor.login(name, "a brand new battery")
    assert stack.api("GET", "/api/v1/me", token)[0] == 401


def test_a_refused_submit_says_how_many_points_are_missing(stack, person):
    user = person("zh")
    user.register(unique("qiong"))
    page = user.go("/generate")
    # Told before pressing: no points, and where points come from.
    short = page.locator("#short-of-points")
    assert "你现在有 0.00 积分，生成一张图需要 1.00 积分。" in short.inner_text()
    assert short.get_by_role("link", name="签到").get_attribute("href") == "/checkin"
    page.fill("#prompt", "没有积分的请求")
    page.select_option("#images", "2")
    assert "2.00" in page.locator("#price").inner_text()
    page.click("#generate-form button[type=submit]")
    alert = page.locator("#generate-messages .notice.error")
    alert.wait_for()
    assert "还差 2.00 积分" in alert.inner_text()
    assert alert.get_by_role("link", name="兑换码").get_attribute("href") == "/redeem"
    assert page.locator("#tasks article.task").count() == 0
    shot(page, "flow-short-of-points-zh-desktop")


def test_a_state_changing_request_without_its_csrf_token_is_refused(stack, person):
    user = person("zh")
    user.register(unique("csrf"))
    request = user.context.request
    refused = request.post(f"{stack.base}/checkin")
    assert refused.status == 403
    csrf = user.page.evaluate("JSON.parse(document.body.getAttribute('hx-headers'))['X-CSRF-Token']")
    accepted = request.post(f"{stack.base}/checkin", headers={"X-CSRF-Token": csrf, "HX-Request": "true"})
    assert accepted.status == 200
    # The API taken with the cookie: the same rule.
    assert request.post(f"{stack.base}/api/v1/checkins").status == 403
    assert request.post(f"{stack.base}/api/v1/checkins", headers={"X-CSRF-Token": csrf}).status == 200
    # A form posted from another site is refused before anything else.
    foreign = request.post(f"{stack.base}/checkin", headers={"X-CSRF-Token": csrf, "Origin": "https://evil.example"})
    assert foreign.status == 403
    # The session cookie: HttpOnly and SameSite=Strict, out of the scripts' reach.
    cookie = next(c for c in user.context.cookies() if c["name"] == "zhihui_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert "zhihui_session" not in user.page.evaluate("document.cookie")


def test_a_thousand_character_chinese_prompt_and_negative_prompt_are_submitted_from_the_page(stack, person):
    # The longest prompt and negative prompt the form allows, in Chinese: about 18 KB
    # URL-encoded, past a default 16 KB form limit. The page must take them like any other.
    user = person("zh")
    name = unique("changwen")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 1, "长提示词测试")
    page = user.go("/generate")
    prompt = ("江南水乡小桥流水人家" * 100)[:1000]
    negative = ("模糊变形多余的手指" * 120)[:1000]
    page.locator("#generate-form details summary").click()
    page.fill("#negative_prompt", negative)
    card = submit(page, prompt)
    assert card.locator(".prompt").inner_text() == prompt
    assert page.locator("#generate-messages .notice.error").count() == 0
    token = stack.token(name, "correct horse")
    # (The list is the read model's, a projection's batch behind the submit.)
    tasks = wait_until(lambda: (lambda listed: listed if listed["tasks"] else None)(stack.api("GET", "/api/v1/tasks", token)[1]), "the task listed")
    assert tasks["tasks"][0]["prompt"] == prompt
    assert tasks["tasks"][0]["negative_prompt"] == negative


def test_after_logging_out_the_browser_shows_none_of_the_users_images_from_its_cache(stack, person):
    # A shared computer: the image was seen while signed in; after logging out, opening its
    # address in the same browser must not show it from the cache.
    user = person("zh")
    name = unique("wangba")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 1, "网吧测试")
    page = user.go("/generate")
    submit(page, "网吧里的一台旧电脑", steps=4)
    image = page.locator("#tasks article.task").first.locator(".images img")
    image.wait_for(timeout=60_000)
    wait_until(lambda: page.evaluate("(img) => img.complete && img.naturalWidth > 0", image.element_handle()), "the image to load")
    src = image.get_attribute("src")
    # The page's own fetch goes through the browser's HTTP cache, as the <img> did.
    fetch = "async (src) => { const r = await fetch(src); return [r.status, r.headers.get('content-type')]; }"
    assert page.evaluate(fetch, src)[0] == 200
    page.locator("form[action='/logout'] button[type=submit]").click()
    page.wait_for_url(re.compile(r".*/login.*"))
    status, content_type = page.evaluate(fetch, src)
    assert status != 200, f"the image came back after logout ({status}, {content_type})"
    assert "image" not in (content_type or "")


def test_a_creator_publishes_with_the_prompt_hidden_and_a_visitor_likes_and_follows_by_keyboard(stack, person):
    """A creator publishes an image from their history with the prompt kept private; a visitor
    lands on the gallery, signs up, likes the work and follows its creator with the keyboard
    alone and without a reload, finds it in their feed, and makes one like it."""
    admin = stack.token(*ADMIN)
    creator = person("zh")
    name = unique("huajia")
    creator.register(name)
    me = stack.api("GET", "/api/v1/me", stack.token(name, "correct horse"))[1]
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "5", "reason": "创作激励"})[0] == 201
    secret_prompt = "月光下的敦煌飞天，金色丝带，壁画质感"
    status, task = stack.api("POST", "/api/v1/tasks", stack.token(name, "correct horse"), {"prompt": secret_prompt, "steps": 4})
    assert status == 201, task
    token = stack.token(name, "correct horse")
    wait_until(lambda: stack.api("GET", f"/api/v1/tasks/{task['task_id']}", token)[1]["status"] == "succeeded", "the image")

    # From the history card to the publish form; the prompt stays private.
    page = creator.go("/history")
    page.locator(f"#task-{task['task_id']}").get_by_role("link", name="发布到画廊").click()
    page.wait_for_url("**/gallery/publish?task=*")
    page.fill("#title", "敦煌·月下飞天")
    page.fill("#description", "试了三次才满意。")
    # A prompt is the creator's to share: the form starts with it private.
    assert not page.is_checked("input[name=prompt_shown]")
    page.click("form.publish button[type=submit]")
    page.wait_for_url(re.compile(r".*/gallery/works/[0-9a-f-]{36}\?done=published$"))
    work_url = page.url.split("?")[0]
    assert page.locator("h1").inner_text() == "敦煌·月下飞天"
    # The creator is told it is out there; a reader of the same address is not.
    assert "已发布到画廊" in page.locator(".work-side .notice.success").inner_text()
    assert secret_prompt not in page.content()
    assert "作者没有公开提示词" in page.content()

    # A visitor meets the gallery, not a login form; the work is there without its prompt.
    visitor = person("zh", viewport=(390, 844))
    page = visitor.go("/")
    page.wait_for_url("**/gallery")
    assert page.locator(".welcome h1").is_visible()
    page.get_by_role("link", name="敦煌·月下飞天").first.click()
    page.wait_for_url(work_url)
    assert secret_prompt not in page.content()
    image = page.locator(".work-images img").first
    response = visitor.context.request.get(f"{stack.base}{image.get_attribute('src')}")
    assert response.status == 200 and response.headers["x-aigc-label"] == "1"
    assert secret_prompt.encode() not in response.body()
    page = visitor.go(work_url.replace(stack.base, "") + "?done=published")
    assert page.locator(".notice.success").count() == 0

    # They sign up, come back, and like it with the keyboard: the count moves, no reload.
    fan = unique("guanzhong")
    visitor.register(fan)
    page = visitor.go(work_url.replace(stack.base, ""))
    page.evaluate("window.__stayed = true")
    like = page.locator("form.like button")
    like.focus()
    page.keyboard.press("Enter")
    page.locator("form.like button[aria-pressed=true]").wait_for()
    assert page.locator("form.like [data-field=likes]").inner_text() == "1"
    assert page.evaluate("window.__stayed === true"), "the page reloaded"
    # Pressed again where the keyboard still is (on the new button): taken back, and again:
    # liked once.
    wait_until(lambda: page.evaluate("document.activeElement.matches('form.like button')"), "the focus back on the like button")
    page.keyboard.press("Enter")
    page.locator("form.like button[aria-pressed=false]").wait_for()
    assert page.locator("form.like [data-field=likes]").inner_text() == "0"
    wait_until(lambda: page.evaluate("document.activeElement.matches('form.like button')"), "the focus back on the like button")
    page.keyboard.press("Enter")
    page.locator("form.like button[aria-pressed=true]").wait_for()
    assert page.locator("form.like [data-field=likes]").inner_text() == "1"

    # To the creator's page, and follow by keyboard.
    page.get_by_role("link", name=name).first.click()
    page.wait_for_url("**/gallery/creators/*")
    page.evaluate("window.__stayed = true")
    follow = page.locator("form.follow button")
    follow.focus()
    page.keyboard.press("Enter")
    page.locator("form.follow button[aria-pressed=true]").wait_for()
    page.locator("#follower-count", has_text="1 位粉丝").wait_for()
    assert page.evaluate("window.__stayed === true"), "the page reloaded"
    wait_until(lambda: page.evaluate("document.activeElement.matches('form.follow button')"), "the focus back on the follow button")

    # Their likes and their feed: the creator's next work reaches the feed.
    # (The likes page is the read model's: drawn again until it has the like.)
    wait_until(lambda: visitor.go("/gallery/likes").get_by_role("link", name="敦煌·月下飞天").count() > 0, "the like listed")
    status, second = stack.api("POST", "/api/v1/tasks", token, {"prompt": "敦煌的沙丘与驼队", "steps": 4})
    assert status == 201, second
    wait_until(lambda: stack.api("GET", f"/api/v1/tasks/{second['task_id']}", token)[1]["status"] == "succeeded", "the second image")
    status, published = stack.api("POST", "/api/v1/gallery/works", token, {"task_id": second["task_id"], "title": "沙丘驼队", "prompt_shown": True})
    assert status == 201, published

    def in_feed():
        page = visitor.go("/gallery/feed")
        return page.get_by_role("link", name="沙丘驼队").count() > 0

    wait_until(in_feed, "the new work in the follower's feed", timeout=10)
    page = visitor.page
    page.screenshot(path=str(stack_screenshot("gallery-feed-after-follow-zh-phone.png")), full_page=True)

    # "Make one like this" fills the generate form with the shown prompt and the settings.
    page = visitor.go(f"/gallery/works/{published['work_id']}")
    page.get_by_role("link", name="做一张同款").click()
    page.wait_for_url("**/generate?from_work=*")
    assert page.input_value("#prompt") == "敦煌的沙丘与驼队"
    assert page.input_value("#steps") == "4"


def test_a_failed_request_says_what_happened_in_the_page_language_and_keeps_what_was_typed(stack, person):
    # Whatever fails (a dropped connection, a proxy's own 413, an address that does not exist),
    # the person reads what happened in their language, and what they typed is still there.
    cases = [
        ("zh", "连接中断", "提交的内容太长", "找不到这个页面或内容。", "一只在雪地里奔跑的红狐狸，电影感光线"),
        ("en", "The connection dropped", "too long for this form", "There is no such page or item.", "a red fox running in the snow"),
    ]
    for lang, offline, too_large, missing, prompt in cases:
        user = person(lang, (390, 844))
        user.register(unique("shibai"))
        page = user.go("/generate")
        page.fill("#prompt", prompt)
        alert = page.locator("#generate-messages .notice.error")

        def dropped(route):
            if route.request.method == "POST":
                route.abort("connectionreset")
            else:
                route.continue_()

        page.route("**/generate", dropped)
        page.click("#generate-form button[type=submit]")
        alert.wait_for()
        assert offline in alert.inner_text()
        assert page.input_value("#prompt") == prompt
        page.unroute("**/generate")

        def refused_by_a_proxy(route):
            if route.request.method == "POST":
                route.fulfill(status=413, content_type="text/plain", body="Request Entity Too Large")
            else:
                route.continue_()

        page.route("**/generate", refused_by_a_proxy)
        page.click("#generate-form button[type=submit]")
        wait_until(lambda: too_large in alert.inner_text(), what="the 413 said")
        assert page.input_value("#prompt") == prompt
        assert page.locator("#tasks article.task").count() == 0
        page.unroute("**/generate")
        page.screenshot(path=str(stack_screenshot(f"failure-413-{lang}-phone.png")), full_page=True)

        response = page.goto(f"{stack.base}/画廊/没有这个页面")
        assert response.status == 404
        assert response.headers["content-type"].startswith("text/html")
        assert page.locator("[data-failure]").inner_text() == missing
        assert page.locator("header nav a[href='/gallery']").count() == 1
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the 404 page is {width} px wide on a 390 px phone"
        page.screenshot(path=str(stack_screenshot(f"not-found-{lang}-phone.png")), full_page=True)
        # htmx logs the failures this test causes on purpose; nothing else may be logged.
        expected = ("htmx:afterRequest", "htmx:sendError", "Response Status Error Code 413")
        user.problems = [problem for problem in user.problems if not problem.startswith(expected)]


def test_a_prompt_sent_after_the_session_ended_comes_back_after_signing_in(stack, person):
    user = person("zh", (390, 844))
    name = unique("guoqi")
    user.register(name)
    page = user.go("/generate")
    prompt = "黄昏时分的江南古镇，小桥流水，水墨画风格"
    page.fill("#prompt", prompt)
    # The session ends (expired, or signed out in another tab) while the person types.
    user.context.clear_cookies()
    page.click("#generate-form button[type=submit]")
    page.wait_for_url("**/login**")
    page.fill("#username", name)
    page.fill("#password", "correct horse")
    page.locator("form", has=page.locator("#username")).locator("button[type=submit]").click()
    page.wait_for_url("**/generate")
    assert page.input_value("#prompt") == prompt
    # Given back once: the next visit starts empty.
    page = user.go("/generate")
    assert page.input_value("#prompt") == ""


def test_a_prompt_being_typed_stays_when_the_language_is_switched(stack, person):
    user = person("zh", (390, 844))
    user.register(unique("qiehuan"))
    page = user.go("/generate")
    prompt = "月光下的竹林，一只熊猫在吃竹子"
    page.fill("#prompt", prompt)
    page.locator("#generate-form details summary").click()
    page.fill("#negative_prompt", "模糊")
    page.locator("form.lang-switch button").click()
    page.wait_for_load_state()
    wait_until(lambda: page.evaluate("document.documentElement.lang") == "en", "the page in English")
    assert page.input_value("#prompt") == prompt
    assert page.locator("#negative_prompt").input_value() == "模糊"
    # Given back once: the next visit starts empty.
    page = user.go("/generate")
    assert page.input_value("#prompt") == ""


def test_a_field_error_is_said_in_the_pages_language(stack, person):
    """Ordinary mistakes, typed in the page: each rule is said in the page's language, never in the
    API's English inside a Chinese page (or Chinese inside an English one)."""
    said = {
        "zh": {"prompt": "提示词：不能为空", "phone": "手机号：须带国家代码（+...），11 位中国大陆手机号除外"},
        "en": {"prompt": "Prompt: must not be empty",
               "phone": "Phone number: needs a country code (+...) unless it is an 11-digit mainland mobile number"},
    }
    for lang in ("zh", "en"):
        for size, viewport in (("phone", (390, 844)), ("desktop", (1366, 768))):
            visitor = person(lang, viewport)
            page = visitor.go("/login")
            page.fill("#phone", "2025550123")
            page.click("#with-code ~ form[action^='/login/code'] button")
            page.locator(".notice.error").wait_for()
            assert page.locator(".notice.error").inner_text() == said[lang]["phone"]
            page.screenshot(path=str(stack_screenshot(f"field-error-phone-{lang}-{size}.png")), full_page=True)
            user = person(lang, viewport)
            user.register(unique("kongge"))
            page = user.go("/generate")
            page.fill("#prompt", "    ")
            page.click("#generate-form button[type=submit]")
            messages = page.locator("#generate-messages")
            wait_until(lambda: messages.inner_text().strip(), "the prompt's error")
            assert messages.inner_text().strip() == said[lang]["prompt"], messages.inner_text()
            # What was typed stays.
            assert page.input_value("#prompt") == "    "
            page.screenshot(path=str(stack_screenshot(f"field-error-prompt-{lang}-{size}.png")), full_page=True)


def test_one_clock_the_browsers_zone_on_every_time_of_a_page(stack, person):
    """A reader in New York: the first page, drawn before the browser told its zone, names the zone
    it used; from then on every time (the server's and the live estimate the script draws) is New
    York time in one format, with no zone to misread."""
    user = person("en", timezone="America/New_York")
    page = user.go("/login")
    assert page.locator("body").get_attribute("data-tz-label") == "UTC+8"
    name = unique("niuyue")
    user.register(name)
    page = user.go("/generate")
    offset = page.evaluate("-new Date().getTimezoneOffset()")
    assert offset in (-300, -240)
    assert page.locator("body").get_attribute("data-tz-offset") == str(offset)
    assert page.locator("body").get_attribute("data-tz-label") is None
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 4, "时钟")
    page = user.go("/generate")
    user.accept_dialogs()
    for prompt in ("Brooklyn Bridge at dawn", "Central Park in snow", "Times Square at night"):
        submit(page, prompt, steps=50, images=1)
    waiting = page.locator("#tasks article.task[data-status=queued]").first
    waiting.wait_for()
    estimate = waiting.locator("[data-field=estimate]")
    wait_until(lambda: estimate.is_visible() and estimate.inner_text().strip(), "the waiting task's estimate")
    # New York's wall clock now, as the page should draw it.
    now = page.evaluate("""() => {
        const at = new Date(); const two = (n) => String(n).padStart(2, '0');
        return `${at.getFullYear()}-${two(at.getMonth() + 1)}-${two(at.getDate())} ${two(at.getHours())}`;
    }""")
    when = waiting.locator(".when").inner_text()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", when), when
    assert when.startswith(now) or when[:13] < now, (when, now)
    text = estimate.inner_text()
    if "Expected to start at" in text:
        start = text.split("Expected to start at ", 1)[1]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}", start), text
        assert start[:10] == when[:10] or start > when, (start, when)
    assert "UTC" not in waiting.inner_text()
    page.screenshot(path=str(stack_screenshot("one-clock-new-york-en-desktop.png")), full_page=True)
    for card in page.locator("#tasks article.task").all():
        if card.get_attribute("data-status") in ("queued", "dispatched", "running"):
            button = card.locator("button.danger")
            if button.count():
                button.click()
    wait_until(lambda: user.go("/points").locator("[data-testid=frozen]").inner_text() == "0.00", "every hold released or settled")


def test_a_user_makes_an_api_key_from_the_settings_page_and_revokes_it(stack, person):
    """From the name in the header to the settings page; a key made there is shown once, works,
    and once revoked is refused; all without a reload."""
    user = person("zh")
    name = unique("miyao")
    user.register(name)
    user.accept_dialogs()
    page = user.go("/generate")
    page.locator("header.top .who a.name", has_text=name).click()
    page.wait_for_url("**/settings")
    page.fill("#key-name", "商品图后台")
    page.check("input[name=scope][value='tasks:read']")
    page.select_option("#key-expires", "90")
    page.click("form[hx-post='/settings/keys'] button[type=submit]")
    key = page.locator("[data-testid=new-key]")
    key.wait_for()
    secret = key.inner_text()
    assert secret.startswith("zhk_")
    user.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack.base)
    page.get_by_role("button", name="复制").click()
    page.get_by_role("button", name="已复制").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == secret
    assert page.get_by_role("link", name="接口文档（OpenAPI）").get_attribute("href") == "/api/openapi.json"
    wait_until(lambda: page.input_value("#key-name") == "", "the form emptied once the key is shown")
    status, tasks = stack.api("GET", "/api/v1/tasks", secret)
    assert status == 200, tasks
    row = page.locator("table.keys tbody tr", has_text="商品图后台")
    row.get_by_role("button", name="吊销").click()
    page.locator("table.keys tbody tr", has_text="已吊销").wait_for()
    assert page.locator("[data-testid=new-key]").count() == 0
    assert stack.api("GET", "/api/v1/tasks", secret)[0] == 401
    shot(page, "flow-settings-key-revoked-zh-desktop")


def test_a_user_chooses_a_chinese_display_name_and_finds_it_on_their_public_page(stack, person):
    """On a phone's screen: a display name with a `#` is refused by name with what was typed
    kept; a Chinese one is saved, the header says it, and the public page it links to shows it
    with the username beside it."""
    user = person("zh", (390, 844))
    name = unique("nicheng")
    user.register(name)
    page = user.go("/settings")
    page.fill("#display-name", "小雨#1")
    page.get_by_role("button", name="保存昵称").click()
    page.locator("#display-name-form .notice.error", has_text="不能含 #").wait_for()
    assert page.input_value("#display-name") == "小雨#1"
    shot(page, "flow-settings-display-name-refused-zh-phone")
    page.fill("#display-name", "小雨的画室")
    page.get_by_role("button", name="保存昵称").click()
    page.wait_for_url("**/settings?renamed=1")
    page.locator(".notice.info", has_text="昵称已改为“小雨的画室”").wait_for()
    assert page.locator(".who .name").inner_text() == "小雨的画室"
    shot(page, "flow-settings-display-name-saved-zh-phone")
    page.get_by_role("link", name="我的主页（别人看到的样子）").click()
    page.wait_for_url("**/gallery/creators/*")
    assert page.locator("#creator-name").inner_text() == "小雨的画室"
    assert page.locator(".handle").inner_text() == f"@{name}"
    shot(page, "flow-creator-display-name-zh-phone")


def test_a_phone_user_sets_a_username_and_password_then_logs_in_with_them(stack, person):
    """Someone who signed up with a phone code sets a username and a password in the settings
    (a taken name said in the form, the name typed kept), then logs in with them."""
    user = person("zh", (390, 844))
    phone = "136" + str(int(unique("")[:6], 16) % 10**8).zfill(8)
    login = user.go("/login")
    login.fill("#phone", phone)
    send_code_waiting_out_the_interval(login, login.locator("#with-code ~ form[action^='/login/code'] button"))
    code = wait_until(lambda: stack.login_code(f"+86{phone}"), "the logged code")
    login.fill("#code", code)
    login.locator("form", has=login.locator("#code")).locator("button[type=submit]").click()
    login.wait_for_url("**/generate")
    taken = unique("yiyou")
    person("zh").register(taken)

    page = user.go("/settings")
    form = page.locator("#username-form")
    form.locator("#set-username").fill(taken)
    form.locator("#set-password").fill("西湖 correct horse")
    form.get_by_role("button", name="设置用户名和密码").click()
    page.locator("#username-form .notice.error", has_text="这个用户名已被使用").wait_for()
    assert page.input_value("#set-username") == taken
    shot(page, "flow-settings-username-taken-zh-phone")
    name = unique("shouji")
    page.fill("#set-username", name)
    page.fill("#set-password", "西湖 correct horse")
    page.locator("#username-form").get_by_role("button", name="设置用户名和密码").click()
    page.wait_for_url("**/settings?username_set=1")
    page.locator(".notice.info", has_text=f"现在也可以用用户名 {name} 和密码登录了").wait_for()
    assert page.locator("#current_password").count() == 1
    shot(page, "flow-settings-username-set-zh-phone")

    other = person("zh")
    other.login(name, "西湖 correct horse")
    assert other.page.locator(".who .name").inner_text() == page.locator(".who .name").inner_text()


def test_a_reader_reports_a_work_by_keyboard_and_an_admin_hides_it_from_the_queue(stack, person):
    """On a phone's screen and with the keyboard: a reader reports a work in Chinese ("other"
    without a note is refused by name, what was chosen kept) and is answered in the form without
    a reload; an admin finds the work in the reports' queue with the reason and the note, hides
    it from there, and it is gone from the gallery."""
    admin = stack.token(*ADMIN)
    creator = unique("zuozhe")
    assert stack.api("POST", "/api/v1/auth/register", body={"username": creator, "password": "correct horse"})[0] == 201
    token = stack.token(creator, "correct horse")
    me = stack.api("GET", "/api/v1/me", token)[1]
    assert stack.api("POST", f"/api/v1/admin/accounts/{me['id']}/grants", admin, {"amount": "5", "reason": "创作激励"})[0] == 201
    status, task = stack.api("POST", "/api/v1/tasks", token, {"prompt": "老小区的夜景，路灯下的单元门", "steps": 4})
    assert status == 201, task
    wait_until(lambda: stack.api("GET", f"/api/v1/tasks/{task['task_id']}", token)[1]["status"] == "succeeded", "the image")
    status, work = stack.api("POST", "/api/v1/gallery/works", token, {"task_id": task["task_id"], "title": "单元门的灯", "prompt_shown": True})
    assert status == 201, work

    reader = person("zh", (390, 844))
    reader.register(unique("jubao"))
    page = reader.go(f"/gallery/works/{work['work_id']}")
    page.evaluate("window.__stayed = true")
    summary = page.locator(".report-work > summary")
    summary.focus()
    page.keyboard.press("Enter")
    other = page.get_by_label("其他", exact=True)
    other.focus()
    page.keyboard.press("Space")
    assert other.is_checked()
    submit = page.get_by_role("button", name="提交举报")
    submit.focus()
    page.keyboard.press("Enter")
    page.locator("#report-messages .notice.error", has_text="选择“其他”原因时必须填写").wait_for()
    assert other.is_checked(), "the reason chosen is kept"
    page.fill("#report-note", "画的是我家楼下，没经过我们同意")
    submit.focus()
    page.keyboard.press("Enter")
    page.locator("#report-messages .notice.success", has_text="已收到你的举报").wait_for()
    assert page.evaluate("window.__stayed === true"), "the page reloaded"
    shot(page, "flow-report-sent-zh-phone")

    staff = person("zh")
    staff.login(*ADMIN)

    def queued():
        return staff.go("/admin/reports").get_by_role("heading", name="单元门的灯").count() > 0

    wait_until(queued, "the reported work in the admins' queue")
    page = staff.page
    section = page.locator("section.reported", has=page.get_by_role("heading", name="单元门的灯"))
    assert "画的是我家楼下，没经过我们同意" in section.inner_text()
    assert "其他 × 1" in section.inner_text()
    shot(page, "flow-admin-reports-zh-desktop")
    section.get_by_role("button", name="隐藏").click()
    page.wait_for_url("**/admin/reports?done=hidden")
    page.locator(".notice.success", has_text="作品已隐藏").wait_for()
    assert page.get_by_role("heading", name="单元门的灯").count() == 0
    assert stack.api("GET", f"/api/v1/gallery/works/{work['work_id']}")[0] == 404
    wait_until(lambda: any(row["work_id"] == work["work_id"] and row["status"] == "hidden"
                           for row in stack.api("GET", "/api/v1/me/works", token)[1]), "the creator's list saying hidden")
