"""Every state-changing button of the pages, pressed in a browser the way a person presses it
(confirmations answered), and what changed checked on the page and through the API: prioritise,
add a server, drain, resume and remove it, change a role, revoke a code batch, add stock, end a
promotion. (Logging out is pressed in test_flows.)"""

import re
import time

from conftest import ADMIN, shot, unique, wait_until
from test_flows import grant, submit


def iso(seconds):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def test_a_user_prioritises_a_waiting_task_and_it_moves_ahead_for_its_fee(stack, person):
    user = person("zh")
    name = unique("chadui")
    user.register(name)
    admin = person("zh")
    admin.login(*ADMIN)
    grant(admin, name, 20, "测试优先")
    page = user.go("/generate")
    user.accept_dialogs()
    # Four long tasks on two servers: two run, two wait in the queue (nothing is staged ahead
    # in this stack).
    for prompt in ("秋天的枫林", "冬日的湖面", "春天的樱花", "夏夜的星空"):
        submit(page, prompt, steps=50, images=1)
    queued = page.locator("#tasks article.task[data-status=queued]")
    wait_until(lambda: queued.count() == 2, "two tasks waiting in the queue")
    # Newest first: the last one submitted waits at place 2.
    last = page.locator("#tasks article.task", has_text="夏夜的星空").first
    first = page.locator("#tasks article.task", has_text="春天的樱花").first
    wait_until(lambda: "排队第 2 位" in last.inner_text(), "the last task at place 2")
    # The two sent to servers say where: running there, or waiting there (the dispatcher may
    # keep a task for the server that has its model loaded); the queued ones say their place.
    for prompt in ("秋天的枫林", "冬日的湖面"):
        sent = page.locator("#tasks article.task", has_text=prompt).first
        wait_until(lambda: re.search(r"正在服务器 gpu-\d 上生成。|已交给服务器 gpu-\d，在那里等候", sent.inner_text()), f"{prompt} on a server")
    wait_until(lambda: "正在服务器 gpu-" in page.locator("#tasks").inner_text(), "a task running on a server")
    page.locator("#balance .amount", has_text="16.00").wait_for()
    last.locator("button", has_text="优先").click()
    assert user.dialogs and "5" in user.dialogs[-1] and "积分" in user.dialogs[-1]
    # Its card is drawn again at place 1; the other card hears its new place from the socket.
    wait_until(lambda: "排队第 1 位" in page.locator("#tasks article.task", has_text="夏夜的星空").first.inner_text(), "the prioritised task at place 1")
    wait_until(lambda: "排队第 2 位" in first.inner_text(), "the task it passed at place 2")
    page.locator("#balance .amount", has_text="11.00").wait_for()
    shot(page, "action-prioritised-zh-desktop")
    page.set_viewport_size({"width": 390, "height": 844})
    shot(page, "action-prioritised-zh-phone")
    task_id = page.locator("#tasks article.task", has_text="夏夜的星空").first.get_attribute("data-task-id")
    token = stack.token(name, "correct horse")
    status, task = stack.api("GET", f"/api/v1/tasks/{task_id}", token)
    passed = stack.api("GET", f"/api/v1/tasks/{first.get_attribute('data-task-id')}", token)[1]
    assert status == 200 and task["prioritised"] == 1, task
    # On a loaded machine a server may free up meanwhile: then the task at place 1 is the one
    # that goes, never the task it passed.
    if task["status"] == "queued":
        assert task["position"] == 1, task
    else:
        assert task["status"] in ("dispatched", "running", "succeeded"), task
    assert not (task["status"] == "queued" and passed["status"] != "queued"), (task, passed)
    # Free the servers for the tests after this one.
    for card in page.locator("#tasks article.task").all():
        if card.get_attribute("data-status") in ("queued", "dispatched", "running"):
            button = card.locator("button.danger")
            if button.count():
                button.click()
    wait_until(lambda: user.go("/points").locator("[data-testid=frozen]").inner_text() == "0.00", "every hold released or settled")


def test_an_admin_adds_drains_resumes_and_removes_a_server_from_the_page(stack, person):
    admin = person("en")
    admin.login(*ADMIN)
    admin.accept_dialogs()
    token = stack.token(*ADMIN)
    page = admin.go("/admin/servers")
    name = unique("gpu-try-")
    page.fill("#server-name", name)
    # Nothing listens there: the server is in the pool but never connected, so no task goes to it.
    page.fill("#server-url", "http://127.0.0.1:9")
    page.fill("#server-capacity", "2")
    page.click("form[action='/admin/servers'] button[type=submit]")
    row = page.locator(f"#server-{name}")
    row.wait_for()
    assert "running 0 of 2" in row.inner_text()
    # Added: the form is empty again. The same name again is refused, and what was typed stays.
    wait_until(lambda: page.input_value("#server-name") == "", "the add form emptied")
    page.fill("#server-name", name)
    page.fill("#server-url", "http://127.0.0.1:10")
    page.click("form[action='/admin/servers'] button[type=submit]")
    page.locator("#servers-messages .notice.error").wait_for()
    assert "A server of that name exists." in page.locator("#servers-messages").inner_text()
    assert page.input_value("#server-name") == name
    assert page.input_value("#server-url") == "http://127.0.0.1:10"

    def listed():
        status, body = stack.api("GET", "/api/v1/admin/backends", token)
        assert status == 200, body
        return {server["name"]: server for server in body}

    assert name in listed()
    row.locator("button", has_text="Drain").click()
    row.locator("button", has_text="Resume").wait_for()
    assert admin.dialogs and name in admin.dialogs[-1]
    server = listed()[name]
    assert server["draining"] is True, server
    shot(page, "action-server-draining-en-desktop")
    row.locator("button", has_text="Resume").click()
    row.locator("button", has_text="Drain").wait_for()
    server = listed()[name]
    assert server["draining"] is False, server
    row.locator("button", has_text="Remove").click()
    wait_until(lambda: page.locator(f"#server-{name}").count() == 0, "the server's row gone")
    assert name not in listed()


def test_an_admin_makes_a_user_an_admin_and_back_from_the_page(stack, person):
    user = person("zh")
    name = unique("juese")
    user.register(name)
    user_id = stack.api("GET", "/api/v1/me", stack.token(name, "correct horse"))[1]["id"]
    admin = person("zh")
    admin.login(*ADMIN)
    admin.accept_dialogs()
    page = admin.go(f"/admin/users/{user_id}")
    page.select_option("#role", "admin")
    page.click("#role-title ~ form button[type=submit]")
    wait_until(lambda: "管理员" in page.locator("#user-detail .hint").first.inner_text(), "the new role shown")
    assert admin.dialogs
    # The change ended the user's sessions: signed in again, the admin pages open.
    user.login(name, "correct horse")
    user.go("/admin")
    # And back: the admin pages close to them again.
    page.select_option("#role", "user")
    page.click("#role-title ~ form button[type=submit]")
    wait_until(lambda: "管理员" not in page.locator("#user-detail .hint").first.inner_text(), "the role back to user")
    user.login(name, "correct horse")
    user.go("/admin", status=403)


def test_an_admin_revokes_a_code_batch_and_its_codes_stop_working(stack, person):
    token = stack.token(*ADMIN)
    now = time.time()
    note = unique("作废测试")
    status, batch = stack.api("POST", "/api/v1/admin/code-batches", token, {
        "count": 3, "points": "5", "valid_from": iso(now - 60), "valid_until": iso(now + 86400), "note": note})
    assert status == 202, batch
    batch_id = batch["batch_id"]
    wait_until(lambda: stack.api("GET", f"/api/v1/admin/code-batches/{batch_id}", token)[1]["status"] == "issued", "the batch issued")
    import urllib.request
    request = urllib.request.Request(f"{stack.base}/api/v1/admin/code-batches/{batch_id}/codes.csv")
    request.add_header("authorization", f"Bearer {token}")
    code = urllib.request.urlopen(request).read().decode().splitlines()[1].split(",")[1]
    admin = person("zh")
    admin.login(*ADMIN)
    admin.accept_dialogs()
    page = admin.go("/admin/codes")
    card = page.locator(f"#batch-{batch_id}")
    card.locator(f"#revoke-{batch_id}").fill("渠道泄露，全部作废")
    card.locator("button", has_text="作废").click()
    wait_until(lambda: page.locator(f"#batch-{batch_id} .state-revoked").count() == 1, "the batch shown revoked")
    assert admin.dialogs
    shot(page, "action-batch-revoked-zh-desktop")
    assert stack.api("GET", f"/api/v1/admin/code-batches/{batch_id}", token)[1]["status"] == "revoked"
    redeemer = unique("duihuan")
    assert stack.api("POST", "/api/v1/auth/register", body={"username": redeemer, "password": "correct horse"})[0] == 201
    status, problem = stack.api("POST", "/api/v1/codes/redeem", stack.token(redeemer, "correct horse"), {"code": code})
    assert status == 409 and problem["type"] == "/problems/code-revoked", problem


def test_an_admin_adds_stock_and_ends_a_promotion_from_the_page(stack, person):
    token = stack.token(*ADMIN)
    now = time.time()
    title = unique("加库存测试")
    status, sale = stack.api("POST", "/api/v1/admin/promotions", token, {
        "title": title, "points": "10", "price": "0", "stock": 3, "starts_at": iso(now - 60), "ends_at": iso(now + 3600)})
    assert status == 201, sale
    promotion_id = sale["promotion_id"]
    admin = person("en")
    admin.login(*ADMIN)
    admin.accept_dialogs()
    page = admin.go("/admin/promotions")
    card = page.locator(f"#promotion-{promotion_id}")
    card.locator(f"#add-{promotion_id}").fill("7")
    card.locator("button", has_text="Add").click()
    wait_until(lambda: stack.api("GET", f"/api/v1/admin/promotions/{promotion_id}", token)[1]["stock"] == 10, "the stock raised to 10")
    wait_until(lambda: "10" in page.locator(f"#promotion-{promotion_id}").inner_text(), "the new stock shown")
    page.locator(f"#promotion-{promotion_id}").locator("button", has_text="End").click()
    wait_until(lambda: page.locator(f"#promotion-{promotion_id} .state-ended").count() == 1, "the promotion shown ended")
    assert admin.dialogs and title in admin.dialogs[-1]
    shot(page, "action-promotion-ended-en-desktop")
    claimer = unique("qiang")
    assert stack.api("POST", "/api/v1/auth/register", body={"username": claimer, "password": "correct horse"})[0] == 201
    status, problem = stack.api("POST", f"/api/v1/promotions/{promotion_id}/claims", stack.token(claimer, "correct horse"))
    assert status == 409, problem


def test_an_admin_creates_two_batches_in_a_row_from_the_same_page(stack, person):
    """Each created batch answers with a fresh key for the form: the next one is another
    request, not a repeat of the first (which the server would refuse as a reused key)."""
    admin = person("zh")
    admin.login(*ADMIN)
    page = admin.go("/admin/codes")
    notes = [unique("第一批"), unique("第二批")]
    for note in notes:
        page.fill("#count", "2")
        page.fill("#note", note)
        page.click("#new-batch ~ form button[type=submit]")
        wait_until(lambda: page.locator("#batches article.batch", has_text=note).count() == 1, f"the batch {note} shown")
    assert page.locator("#codes-messages .notice").count() == 0, page.locator("#codes-messages").inner_text()
    shot(page, "action-two-batches-zh-desktop")
    # Both are batches of the server's, not two cards of one.
    for note in notes:
        # The list is the read model's: drawn again until it has both.
        wait_until(lambda: admin.go("/admin/codes").locator("#batches article.batch", has_text=note).count() == 1, f"{note} listed")
