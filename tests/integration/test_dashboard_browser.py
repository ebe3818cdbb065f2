"""The dashboard in a real browser (Debian's chromium, headless) on a live stack (`launcher.run`, the tiny
model): once the trainer is done and every service still serves, the page's figures equal the coordinator's
ledger and metrics.jsonl, the charts are drawn, a batch opens in the rollout browser with its groups, samples
and rewards (the batch's mean reward is its metrics row's), and the console holds no error. Screenshots of
both views land in the run folder."""

from __future__ import annotations

import json
import re

import pytest

from launcher.run import run
from protos import coordinator_pb2 as pb
from rlcommon.metrics import read_jsonl
from tests.integration import browser
from tests.integration.stacks import stack_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # slow: its fixture starts a stack and a browser (~20 s)

STEPS = 10


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    reason = browser.missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium.webdriver.common.by import By

    run_dir = tmp_path_factory.mktemp("dashboard")
    cfg = stack_config(run_dir, steps=STEPS, run_id="dash-browser", overrides=["--coordinator.ess_threshold=0.99"])
    found: dict = {"run_dir": run_dir}

    def before_stop(stack):
        status = stack.client.call("GetStatus", pb.GetStatusRequest())
        found["ledger"] = {"trained": status.batches.trained, "total": status.batches.total}
        found["syncs"] = len(stack.client.call("ListSyncs", pb.ListSyncsRequest(limit=100)).syncs)
        driver = browser.start_browser()
        try:
            driver.get(stack.dashboard_url)
            browser.wait_for(lambda: driver.find_element(By.ID, "connection").get_attribute("data-steps") == str(STEPS),
                             what=f"{STEPS} steps on the page")
            browser.wait_for(lambda: all(driver.find_element(By.ID, c).get_attribute("data-ready") == "1" for c in
                                         ("chart-reward", "chart-ess", "chart-delta", "chart-staleness")),
                             what="the charts")
            found["page"] = {name: driver.find_element(By.ID, name).get_attribute("data-value") for name in
                             ("count-trained", "count-total", "deadletter-length", "last-step", "last-reward",
                              "last-ess-lag")}
            found["canvases"] = len(driver.find_elements(By.CSS_SELECTOR, ".chart canvas"))
            found["sampler_rows"] = [r.get_attribute("data-sampler")
                                     for r in driver.find_elements(By.CSS_SELECTOR, "#samplers tbody tr")]
            browser.wait_for(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#syncs tbody tr")) == found["syncs"],
                             what="every sync in the table")
            found["sync_rows"] = len(driver.find_elements(By.CSS_SELECTOR, "#syncs tbody tr"))
            driver.save_screenshot(str(run_dir / "dashboard-overview.png"))
            browser.open_rollouts(driver)
            found["batch"] = int(driver.find_element(By.ID, "groups").get_attribute("data-batch"))
            found["groups"] = [
                [float(r.get_attribute("data-value")) for r in g.find_elements(By.CSS_SELECTOR, ".reward")]
                for g in driver.find_elements(By.CSS_SELECTOR, "#groups .group")]
            found["coloured_tokens"] = len(driver.find_elements(By.CSS_SELECTOR, "#groups .tok"))
            found["versions"] = [(s.find_element(By.CSS_SELECTOR, ".versions").text,
                                  {t.get_attribute("title").split(" · ")[0] for t in s.find_elements(By.CSS_SELECTOR, ".tok")})
                                 for s in driver.find_elements(By.CSS_SELECTOR, "#groups .sample")]
            found["vswitches"] = len(driver.find_elements(By.CSS_SELECTOR, "#groups .vswitch"))
            found["summary"] = driver.find_element(By.ID, "batch-summary").text
            driver.save_screenshot(str(run_dir / "dashboard-rollouts.png"))
            found["errors"] = browser.console_errors(driver)
        finally:
            driver.quit()

    run(cfg, progress_bar=False, before_stop=before_stop)
    found["rows"] = read_jsonl(run_dir / "metrics.jsonl")
    return found


def test_the_page_shows_the_ledger_and_the_last_metrics_row(seen):
    page, rows = seen["page"], seen["rows"]
    assert int(page["count-trained"]) == seen["ledger"]["trained"] == STEPS
    assert int(page["count-total"]) == seen["ledger"]["total"]
    assert int(page["deadletter-length"]) == 0
    last = rows[-1]
    assert int(page["last-step"]) == last["step"] == STEPS - 1
    assert float(page["last-reward"]) == pytest.approx(last["reward_mean"], rel=1e-12)
    assert float(page["last-ess-lag"]) == pytest.approx(last["ess_lag"], rel=1e-12)
    assert seen["canvases"] >= 6 and seen["sampler_rows"] == ["sampler-0"]
    assert seen["sync_rows"] == seen["syncs"] >= 1  # ess_threshold 0.99: the ESS falls below it in 10 steps


def test_the_rollout_browser_shows_a_trained_batch_with_its_rewards(seen):
    rows_by_batch = {row["batch_id"]: row for row in seen["rows"]}
    batch = seen["batch"]
    assert batch == STEPS - 1  # the newest trained batch first (every planned batch is trained by now)
    groups = seen["groups"]
    assert len(groups) == 8 and all(len(g) == 4 for g in groups)  # configs/default.toml: B = 8, G = 4
    rewards = [r for g in groups for r in g]
    assert sum(rewards) / len(rewards) == pytest.approx(rows_by_batch[batch]["reward_mean"], abs=1e-9)
    assert seen["coloured_tokens"] >= 32  # every sample has at least one token
    assert "32 of 32 samples" in seen["summary"] and "log-ratios: yes" in seen["summary"]
    # sampler.update_mode "wait" (the default): one weight version per response, named by its label and by
    # every token's tooltip, and no version-change badge (test_dashboard_api.py has a response spanning versions)
    assert len(seen["versions"]) == 32 and seen["vswitches"] == 0
    assert all(re.fullmatch(r"v\d+", label) and tokens == {label} for label, tokens in seen["versions"])


def test_no_javascript_error_and_the_screenshots_exist(seen):
    assert seen["errors"] == [], json.dumps(seen["errors"], indent=1)
    for name in ("dashboard-overview.png", "dashboard-rollouts.png"):
        assert (seen["run_dir"] / name).stat().st_size > 10_000
