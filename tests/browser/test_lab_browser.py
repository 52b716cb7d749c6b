"""Chapter 2 in a real browser: JupyterLab runs the notebook, Chromium steps its page map.

A copy of notebooks/02_block_tables.ipynb (outputs cleared) is served by a headless JupyterLab
on a free local port; Playwright drives Chromium to run all cells on the CPU profile, checks
that no cell raised, drags the allocator trace's slider and checks the page map is redrawn.
The screenshot goes to build/browser/. Skipped when Chromium or Playwright is missing.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_block_tables.ipynb"
CHROMIUM = Path(os.environ.get("KVLAB_CHROMIUM", "/usr/bin/chromium"))
SHOTS = ROOT / "build" / "browser"
BUDGET_S = 160  # the whole test, server start to screenshot (pytest start-up adds ~20 s)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"browser test: no Chromium at {CHROMIUM} (apt-get install chromium)"),
]


class Deadline:
    """One time budget shared by every wait; each step gets at most what is left."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def ms(self, step_s: float) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            pytest.fail(f"browser test: over its {BUDGET_S} s budget")
        return 1000 * min(step_s, left)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_cleared(src: Path, dst: Path) -> None:
    """The notebook without outputs, so every output checked below is produced by this run."""
    nb = json.loads(src.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    dst.write_text(json.dumps(nb, indent=1))


def start_lab(root: Path, port: int, token: str, log) -> subprocess.Popen:
    home = root.parent / "jupyter"
    news = home / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no news prompt
    env = dict(os.environ, KVLAB_PROFILE="cpu", JUPYTER_CONFIG_DIR=str(home / "config"),
               JUPYTER_DATA_DIR=str(home / "data"), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--port-retries=0", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={token}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
           f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    return subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_lab(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"JupyterLab did not answer within {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop_lab(proc: subprocess.Popen, base: str, token: str) -> None:
    """Shut the server down with its kernels; kill its process group if it does not go."""
    if proc.poll() is None:
        try:
            req = urllib.request.Request(f"{base}/api/shutdown", method="POST",
                                         headers={"Authorization": f"token {token}"})
            urllib.request.urlopen(req, timeout=5).close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


# The open notebook, through the app JupyterLab exposes as window.jupyterapp.
KERNEL_IDLE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  return !!(panel && panel.content && panel.content.model && panel.sessionContext
            && panel.sessionContext.session && panel.sessionContext.kernelDisplayStatus === 'idle');
}"""
RUN_STATE = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cells = panel.content.model.cells;
  const errors = [];
  let pending = 0;
  for (let i = 0; i < cells.length; i++) {
    const cell = cells.get(i);
    if (cell.type !== 'code') continue;
    for (let j = 0; j < cell.outputs.length; j++) {
      const out = cell.outputs.get(j).toJSON();
      if (out.output_type === 'error') errors.push(`cell ${i}: ${out.ename}: ${out.evalue}`);
    }
    if (cell.executionCount === null && cell.sharedModel.getSource().trim() !== '') pending++;
  }
  return {errors, pending, idle: panel.sessionContext.kernelDisplayStatus === 'idle'};
}"""


def png_bytes(src: str | None) -> bytes:
    assert src and src.startswith("data:image/png;base64,"), f"page map is not an inline PNG: {str(src)[:80]}"
    data = base64.b64decode(src.split(",", 1)[1])
    assert data.startswith(b"\x89PNG"), "page map is not a PNG"
    return data


def test_chapter2_runs_and_steps_in_chromium(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="browser test: pip install playwright")
    deadline = Deadline(BUDGET_S)
    root = tmp_path / "notebooks"
    root.mkdir()
    copy_cleared(NOTEBOOK, root / NOTEBOOK.name)
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "lab.log"
    SHOTS.mkdir(parents=True, exist_ok=True)
    (SHOTS / "02_block_tables-failed.png").unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        proc = start_lab(root, port, token, log)
    try:
        wait_for_lab(proc, f"{base}/api/status?token={token}", deadline.ms(60) / 1000, log_path)
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=str(CHROMIUM), headless=True,
                args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000}, timeout=deadline.ms(30))
            try:
                page = context.pages[0] if context.pages else context.new_page()
                page.set_default_timeout(deadline.ms(30))
                try:
                    check_notebook(page, sync_api.expect, base, token, deadline)
                except BaseException:
                    with contextlib.suppress(Exception):  # keep the original error
                        page.screenshot(path=SHOTS / "02_block_tables-failed.png", timeout=10_000)
                    raise
            finally:
                context.close()
    finally:
        stop_lab(proc, base, token)


def check_notebook(page, expect, base: str, token: str, deadline: Deadline) -> None:
    page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", timeout=deadline.ms(60))
    page.wait_for_function(KERNEL_IDLE, timeout=deadline.ms(60), polling=250)

    # Run > Run All Cells, then wait for the kernel to finish every cell (or stop at an error).
    page.evaluate("() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_function(f"() => {{ const s = ({RUN_STATE})(); return s.idle && (s.pending === 0 || s.errors.length > 0); }}",
                           timeout=deadline.ms(150), polling=500)
    state = page.evaluate(RUN_STATE)
    assert not state["errors"], "cells raised:\n" + "\n".join(state["errors"])

    # The allocator trace's step-through widget: a slider, and the page map it redraws below.
    slider = page.locator(".jupyter-widgets.widget-slider").first
    slider.scroll_into_view_if_needed(timeout=deadline.ms(20))
    cell = page.locator(".jp-Cell", has=slider).first
    image = cell.locator(".widget-output img").first
    expect(image).to_be_visible(timeout=deadline.ms(20))
    before = image.get_attribute("src")
    readout = slider.locator(".widget-readout")
    start_value = readout.inner_text()

    # Drag the handle from the left end to about 60% of the track.
    handle = slider.locator(".noUi-handle").first.bounding_box()
    track = slider.locator(".noUi-target").first.bounding_box()
    y = handle["y"] + handle["height"] / 2
    page.mouse.move(handle["x"] + handle["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(track["x"] + 0.6 * track["width"], y, steps=8)
    page.mouse.up()

    expect(readout).not_to_have_text(start_value, timeout=deadline.ms(10))
    expect(image).not_to_have_attribute("src", before, timeout=deadline.ms(30))
    page.wait_for_function(KERNEL_IDLE, timeout=deadline.ms(30), polling=250)  # the last frame drawn
    after = image.get_attribute("src")
    assert png_bytes(after) != png_bytes(before), "the page map did not change when the slider moved"
    cell.scroll_into_view_if_needed(timeout=deadline.ms(10))
    page.screenshot(path=SHOTS / "02_block_tables.png", timeout=deadline.ms(15))
