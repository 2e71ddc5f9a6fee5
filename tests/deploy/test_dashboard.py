"""The live dashboard: the stats arithmetic against hand-computed values, and the page in a real headless
Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium) under load from ``rnnserve bench``."""

from __future__ import annotations

import base64
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from rnnserve.server.dashboard import StatsHistory, bucket_quantile
from rnnserve.server.metrics import ServerMetrics
from tests.server.server_process import ServerProcess

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def test_bucket_quantile_interpolates_like_promql() -> None:
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 10.0), (math.inf, 10.0)]
    assert bucket_quantile(0.2, buckets) == pytest.approx(0.1)  # rank 2: the top of the first bucket
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 3 / 4)  # rank 5 in (0.1, 0.5]
    assert bucket_quantile(0.9, buckets) == pytest.approx(0.5 + 0.5 * 3 / 4)  # rank 9 in (0.5, 1.0]
    assert bucket_quantile(0.99, [(1.0, 1.0), (math.inf, 4.0)]) == 1.0  # in +Inf: the highest finite bound
    assert bucket_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_stats_history_rates_and_windowed_percentiles() -> None:
    metrics = ServerMetrics("m", 1024, CollectorRegistry())
    metrics.set_pool(num_slots=8, bytes_per_slot=100)
    history = StatsHistory(metrics)
    history.sample(now=1000.0)
    assert history.since(0.0, now=1000.5) == []  # one snapshot: no rate yet
    metrics.generation_tokens.inc(40)
    metrics.prompt_tokens.inc(10)
    metrics.request_success("stop").inc(3)
    metrics.request_success("error").inc(1)
    metrics.request_rejected.inc(2)
    for value in (0.02, 0.03, 0.3):
        metrics.time_to_first_token.observe(value)
    history.sample(now=1002.0)
    point = history.points[-1]
    assert point["t"] == 1002.0
    assert point["generation_tps"] == pytest.approx(20.0) and point["prompt_tps"] == pytest.approx(5.0)
    assert point["requests_per_s"] == pytest.approx(2.0) and point["errors_per_s"] == pytest.approx(0.5)
    assert point["rejected_per_s"] == pytest.approx(1.0)
    assert point["slots_total"] == 8 and point["state_memory_total_bytes"] == 800
    assert 0.025 < point["ttft"]["p50"] <= 0.05 and 0.25 < point["ttft"]["p99"] <= 0.5
    assert point["itl"] == {"p50": None, "p90": None, "p99": None}
    history.sample(now=1040.0)  # more than LATENCY_WINDOW later: nothing new in the window
    assert history.points[-1]["ttft"]["p50"] is None and history.points[-1]["generation_tps"] == 0.0
    assert [p["t"] for p in history.since(1002.0, now=1040.5)] == [1040.0]
    assert [p["t"] for p in history.since(1040.0, now=1045.0)] == [1045.0]  # the sampler fell behind


def test_stats_route_serves_the_server_series(loaded_server: ServerProcess) -> None:
    with httpx.Client(base_url=loaded_server.url, timeout=30) as http:
        page = http.get("/dashboard")
        assert page.status_code == 200 and "/dashboard/dashboard.js" in page.text
        assert http.get("/dashboard/dashboard.js").status_code == 200
        deadline = time.monotonic() + 10
        while not (stats := http.get("/dashboard/stats").json())["points"] and time.monotonic() < deadline:
            time.sleep(0.2)  # the sampler's second snapshot gives the first point
    assert stats["model"] == "random:mingru-tiny" and stats["points"]
    assert stats["points"][-1]["slots_total"] == 8


def chromium_driver(user_data_dir: Path) -> Any:
    """Debian's Chromium, headless, through its chromedriver (Selenium never downloads a browser or driver)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
        "--window-size=1280,900", f"--user-data-dir={user_data_dir}",
    ):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))


# Decodes a PNG data URL in the page and returns [distinct colours, share of pixels unlike the top-left one].
PIXEL_STATS = """
const done = arguments[arguments.length - 1];
const image = new Image();
image.onload = () => {
  const canvas = document.createElement("canvas");
  canvas.width = image.width; canvas.height = image.height;
  const ctx = canvas.getContext("2d");
  ctx.drawImage(image, 0, 0);
  const data = ctx.getImageData(0, 0, image.width, image.height).data;
  const colours = new Set();
  let differ = 0;
  for (let i = 0; i < data.length; i += 4) {
    colours.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
    if (data[i] !== data[0] || data[i + 1] !== data[1] || data[i + 2] !== data[2]) differ += 1;
  }
  done([colours.size, differ / (data.length / 4)]);
};
image.src = arguments[0];
"""

# Pixels of the throughput chart painted in the generation series' colour.
SERIES_PIXELS = """
const canvas = document.getElementById("c-throughput");
const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
let n = 0;
for (let i = 0; i < data.length; i += 4) {
  if (Math.abs(data[i] - 0x4f) < 24 && Math.abs(data[i + 1] - 0xc3) < 24 && Math.abs(data[i + 2] - 0xf7) < 24) n += 1;
}
return n;
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None, reason="needs Debian's chromium and chromium-driver")
def test_dashboard_in_headless_chromium(loaded_server: ServerProcess, tmp_path: Path) -> None:
    pytest.importorskip("selenium", reason="selenium is not installed (a test extra: pip install '.[test]')")
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium_driver(tmp_path / "profile")
    try:
        driver.get(f"{loaded_server.url}/dashboard")
        WebDriverWait(driver, 60, poll_frequency=0.5).until(
            lambda d: d.execute_script(
                "const p = window.rnnserveDashboard.points;"
                "return p.filter(x => x.generation_tps > 0 && x.ttft.p50 !== null).length >= 3;"
            )
        )
        tile = float(driver.find_element("id", "v-generation_tps").text.rstrip("kM"))
        assert tile > 0
        assert driver.find_element("id", "model").text == "random:mingru-tiny"
        assert driver.find_element("id", "v-slots").text.endswith("/ 8")
        # the throughput line is drawn; it lengthens with each sampled point, and three points spanned fewer
        # than 50 pixels in one CI run
        WebDriverWait(driver, 30, poll_frequency=0.5).until(lambda d: d.execute_script(SERIES_PIXELS) > 50)
        png = driver.get_screenshot_as_png()
        data_url = "data:image/png;base64," + base64.b64encode(png).decode()
        colours, differ = driver.execute_async_script(PIXEL_STATS, data_url)
    finally:
        driver.quit()
    shot = Path(os.environ.get("RNNSERVE_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    shot.write_bytes(png)
    assert png.startswith(b"\x89PNG") and colours > 50 and differ > 0.2, (colours, differ)
