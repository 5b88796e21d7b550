"""The `kvmem ui` page in a real headless Chromium (the system's, driven by Playwright):
the README's example, redrawing without a reload, errors beside their fields, the copy
button's command, the keyboard, both screen widths. One server and one browser for the
module; screenshots of a few plans go to ui-screenshots/ (not committed)."""

import json
import re
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.ui_page import (
    README_EXAMPLE,
    README_QUERY,
    SCREENSHOTS,
    browser_context,
    cli,
    cli_error,
    expect,
    serving,
)

DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def server():
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def context(server):
    with browser_context(viewport=DESKTOP) as ctx:
        ctx.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url[:-1])
        ctx.set_default_timeout(20_000)
        yield ctx


@pytest.fixture
def page(context, server):
    page = context.new_page()
    page.set_viewport_size(DESKTOP)
    problems = []
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("request", lambda req: None if req.url.startswith((server.url, "data:"))
            else problems.append(f"fetched from elsewhere: {req.url}"))
    yield page
    page.close()
    assert not problems


def open_plan(page, server, query: str):
    page.goto(f"{server.url}?{query}")
    page.wait_for_selector("#plan:not([hidden])")
    page.wait_for_selector("#results[aria-busy=false]")


def column(page, index: int) -> list[str]:
    return page.locator(f"#ranks tbody tr td:nth-child({index})").all_inner_texts()


def settle(page):
    """Wait for the page's answer to the last input."""
    expect(page.locator("#results")).to_have_attribute("aria-busy", "false")


def shot(page, name: str):
    SCREENSHOTS.mkdir(exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def cli_command(argv: list[str], title: str = "vllm command:") -> str:
    """The command line `kvmem plan ARGV` prints under ``title``."""
    code, out, err = cli(["plan", *argv])
    assert code == 0, err
    lines = out.splitlines()
    return lines[lines.index(title) + 1]


def test_the_readme_example_holds_2560_blocks_on_both_stages(page, server):
    open_plan(page, server, README_QUERY)
    assert column(page, 5) == ["2,560", "2,560"]  # blocks
    assert column(page, 6) == ["40,960", "40,960"]  # tokens
    assert column(page, 10) == ["40,944", "40,944"]  # the longest context that fits
    assert column(page, 9) == ["4.38 GiB", "640.00 MiB"]  # each stage's budget
    assert page.locator("#bars .bar").count() == 2
    assert "40,960 tokens, Maximum concurrency for 40,960 tokens per request: 1.00x" in \
        page.inner_text("#vllm-log")
    # the form holds the query, and the page put the engine it shows in the address bar
    assert page.input_value("#f-layer_partition") == "56,8"
    assert parse_qs(urlsplit(page.url).query) == parse_qs(README_QUERY + "&engine=vllm")
    shot(page, "readme-example-1280")
    page.set_viewport_size(PHONE)
    shot(page, "readme-example-phone")


def test_a_page_without_a_query_shows_the_readme_example(page, server):
    page.goto(server.url)
    page.wait_for_selector("#plan:not([hidden])")
    assert column(page, 5) == ["2,560", "2,560"]
    assert parse_qs(urlsplit(page.url).query) == parse_qs(README_QUERY + "&engine=vllm")


def test_the_inputs_suggest_the_catalogs(page, server):
    from kvmem.plan.gpus import GPU_MEMORY_GIB
    from kvmem.spec import KV_DTYPE_CHOICES, catalog

    open_plan(page, server, "model=qwen3-8b&gpu=H100")
    for field, expected in (("model", [e.hf_id for e in catalog()]),
                            ("gpu", list(GPU_MEMORY_GIB)),
                            ("kv_cache_dtype", list(KV_DTYPE_CHOICES))):
        options = page.locator(f"#{page.get_attribute(f'#f-{field}', 'list')} option")
        assert [o.get_attribute("value") for o in options.all()] == expected, field


def test_changing_pp_redraws_without_a_reload(page, server):
    open_plan(page, server, "model=Qwen%2FQwen3-32B&gpu=H100&max_model_len=40960")
    assert column(page, 1) == ["0"]
    page.evaluate("window.notReloaded = true")
    page.fill("#f-pp", "2")
    expect(page.locator("#ranks tbody tr")).to_have_count(2)
    settle(page)
    assert column(page, 4) == ["0-31", "32-63"]  # vLLM's even split
    assert page.locator("#bars .bar").count() == 2
    assert page.evaluate("window.notReloaded") is True
    assert "pp=2" in page.url
    doc = json.loads(page.evaluate("fetch('/api/plan' + location.search).then(r => r.text())"))
    assert [r["num_blocks"] for r in doc["ranks"]] == [int(t.replace(",", ""))
                                                       for t in column(page, 5)]


def test_a_bad_value_shows_the_cli_error_beside_its_field(page, server):
    open_plan(page, server, "model=Qwen%2FQwen3-32B&gpu=H100")
    page.fill("#f-tp", "3")
    error = page.locator("#e-tp")
    error.wait_for(state="visible")
    assert error.inner_text() == cli_error(["Qwen/Qwen3-32B", "--gpu", "H100", "--tp", "3"])
    assert page.get_attribute("#f-tp", "aria-invalid") == "true"
    assert page.locator("#plan").is_hidden()  # no figures for flags that plan nothing
    assert "--tp" in page.inner_text("#problem")
    shot(page, "error-beside-its-field")
    page.fill("#f-tp", "0")  # argparse's own check, in its own words
    expect(page.locator("#e-tp")).to_contain_text("at least")
    assert page.inner_text("#e-tp") == cli_error(["Qwen/Qwen3-32B", "--tp", "0"])
    page.fill("#f-tp", "2")
    page.wait_for_selector("#plan:not([hidden])")
    assert error.is_hidden() and page.get_attribute("#f-tp", "aria-invalid") is None


def test_a_bad_value_in_a_closed_group_opens_it(page, server):
    page.goto(f"{server.url}?model=qwen3-8b&gpu=H100&cpu_offload_gib=-1")
    page.locator("#e-cpu_offload_gib").wait_for(state="visible")
    assert page.inner_text("#e-cpu_offload_gib") == cli_error(
        ["qwen3-8b", "--gpu", "H100", "--cpu-offload-gib", "-1"])


def test_the_copy_button_copies_the_cli_command(page, server):
    open_plan(page, server, README_QUERY + "&engine=vllm")
    buttons = page.locator("button.copy")
    assert buttons.count() == 2  # per-rank budgets: also the plugin command
    buttons.nth(0).click()
    page.wait_for_selector(".copied:text('Copied')")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == cli_command(README_EXAMPLE + ["--engine", "vllm"])
    buttons.nth(1).click()
    assert page.evaluate("navigator.clipboard.readText()") == cli_command(
        README_EXAMPLE + ["--engine", "vllm"],
        "vllm command with kvmem's plugin (per-rank budgets):")
    # another engine: its command, as `kvmem plan --engine sglang` prints it
    page.select_option("#f-engine", "sglang")
    expect(page.locator("#commands h4").first).to_have_text(re.compile("^sglang"))
    page.locator("button.copy").first.click()
    assert page.evaluate("navigator.clipboard.readText()") == cli_command(
        README_EXAMPLE + ["--engine", "sglang"], "sglang command:")


def test_the_keyboard_reaches_every_input_and_the_copy_button(page, server):
    open_plan(page, server, "model=qwen3-8b&gpu=H100&engine=vllm")
    reached = []
    for _ in range(80):
        page.keyboard.press("Tab")
        focused = page.evaluate("document.activeElement.id || "
                                "document.activeElement.className")
        reached.append(focused)
        if focused == "f-pp":  # typing into the focused field replans
            page.keyboard.type("2")
            expect(page.locator("#ranks tbody tr")).to_have_count(2)
            settle(page)
        if focused == "copy":
            break
    assert reached[0] == "skip" and reached[-1] == "copy", reached
    for field in ("f-model", "f-tp", "f-pp", "f-gpu", "f-engine"):
        assert field in reached
    page.keyboard.press("Enter")
    page.wait_for_selector(".copied:text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == cli_command(
        ["qwen3-8b", "--gpu", "H100", "--pp", "2", "--engine", "vllm"])
    # a choice changes with the arrow keys
    page.focus("#f-engine")
    page.keyboard.press("ArrowDown")
    expect(page.locator("#commands h4").first).to_have_text(re.compile("^sglang"))
    # a closed group opens from the keyboard
    group = page.locator("details.group", has=page.locator("#f-cpu_offload_gib"))
    group.locator("summary").focus()
    page.keyboard.press("Enter")
    assert page.locator("#f-cpu_offload_gib").is_visible()
    # the skip link jumps to the plan
    open_plan(page, server, "model=qwen3-8b&gpu=H100")
    page.keyboard.press("Tab")
    page.keyboard.press("Enter")
    assert page.evaluate("location.hash") == "#results"
    assert page.evaluate("document.activeElement.id") == "results"


def test_phone_width_scrolls_only_vertically(page, server):
    page.set_viewport_size(PHONE)
    open_plan(page, server, "model=qwen3-14b&pp=2&gpu=V100-16GB,V100-32GB&kv_budget=optimal"
                            "&max_model_len=32768&engine=vllm")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    assert page.locator("button.copy").first.is_visible()
    shot(page, "optimal-v100-phone")
    page.set_viewport_size(DESKTOP)
    assert page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
    shot(page, "optimal-v100-1280")


def test_a_plan_that_does_not_fit_says_why_and_what_would(page, server):
    open_plan(page, server, "model=meta-llama%2FLlama-3.1-70B-Instruct&gpu=L40S&tp=2"
                            "&max_model_len=131072&engine=vllm")
    assert page.inner_text("#verdict").startswith("Does not fit")
    warnings = page.locator("#warnings li").all_inner_texts()
    code, _, err = cli(["plan", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "L40S", "--tp",
                        "2", "--max-model-len", "131072", "--check"])
    assert code == 2 and err.removeprefix("kvmem: error: ").strip() in warnings
    assert page.locator("#alternatives li").count() >= 1
    shot(page, "no-fit-alternatives-1280")


def test_a_pasted_config_is_planned(page, server):
    from kvmem.spec.catalog import catalog_config

    open_plan(page, server, "model=qwen3-8b&gpu=H100")
    _, cfg = catalog_config("qwen3-8b")
    page.click("#config-details > summary")
    page.fill("#f-model", "/models/my-qwen")
    page.fill("#f-config", json.dumps(cfg))
    expect(page.locator("#commands code").first).to_contain_text("/models/my-qwen")
    settle(page)
    assert column(page, 5) == [f"{b:,}" for b in [json.loads(cli(
        ["plan", "qwen3-8b", "--gpu", "H100", "--json"])[1])["engine"]["num_blocks"]]]
