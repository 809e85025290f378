"""The build report: report.json sections, report.html with its PNG plots, opened in a real
headless Chromium (skipped only where no Chromium is installed; CI installs it)."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from PIL import Image

PLOTS = ("stages.png", "quarantine.png", "duplicates.png", "mix.png", "lengths.png", "negatives.png")


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_report_json_has_every_section(fixtures_build):
    report = json.loads((fixtures_build / "report.json").read_text())
    assert {"duplicates", "negatives", "grpo_prompts", "shape"} <= set(report)
    assert sum(report["negatives"]["by_type"].values()) == report["negatives"]["total"] > 0
    assert report["duplicates"]["cross_source"] == {"openmanus_rl -> agenttraj_l": 7}
    assert report["shape"]["turns"]["min"] >= 2


def test_validation_figures_per_env(fixtures_build):
    """Per env: actions checked and valid by grammar, quarantined by rule; they add up to the totals."""
    report = json.loads((fixtures_build / "report.json").read_text())
    figures = report["validation_by_env"]
    assert set(report["envs"]) <= set(figures)
    for env, e in figures.items():
        assert e["grammar"] and 0 <= e["actions_valid"] <= e["actions_checked"], env
    # Every fixture quarantine comes from validation, so the per-env rules add up to the total.
    assert sum(n for e in figures.values() for n in e["quarantined"].values()) == report["total"]["quarantined"]
    assert figures["db"]["quarantined"] == {"action_loop": 2, "incomplete_episode": 4}
    # alfworld_53: two `End of the task.` that ALFWorld answered `Nothing happens.`, masked, the record kept.
    assert figures["alfworld"]["actions_checked"] - figures["alfworld"]["actions_valid"] == 2
    assert figures["alfworld"]["refused"] == {"alfworld.command": 2} and figures["alfworld"]["quarantined"] == {}
    assert (figures["alfworld"]["records_masked"], figures["alfworld"]["steps_masked"]) == (1, 2)
    assert figures["mind2web"]["unconfirmed"] == {"mind2web.operation": 1}
    html = (fixtures_build / "report.html").read_text()
    assert "Validation per environment" in html
    for env, e in figures.items():
        assert f"<td>{env}</td><td>yes</td><td>{e['records']}</td><td>{e['actions_checked']}</td>" in html


def test_html_references_every_plot_and_the_plots_are_real_images(fixtures_build):
    html = (fixtures_build / "report.html").read_text()
    for name in PLOTS:
        assert f"report_files/{name}" in html
        with Image.open(fixtures_build / "report_files" / name) as image:
            assert image.format == "PNG" and image.width >= 400 and image.height >= 150
            # Drawn, not blank: more than a handful of colours.
            assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 20
    assert "holds for every source" in html
    assert "agenttraj_l/movie_124" in html  # the cross-source cluster table


def test_report_opens_in_headless_chromium(fixtures_build, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium installed (CI installs it)")
    shot = tmp_path / "report.png"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           "--hide-scrollbars", "--window-size=1200,3000", f"--screenshot={shot}",
           (fixtures_build / "report.html").as_uri()]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    with Image.open(shot) as image:
        rgb = image.convert("RGB")
        assert rgb.size == (1200, 3000)
        colours = rgb.getcolors(maxcolors=1 << 20)
    # The page shows the plots: many colours (text alone on white gives few), and the plot colours
    # themselves (the stage bars' blue) are on screen.
    assert len(colours) > 200
    assert any(abs(r - 0x4C) < 8 and abs(g - 0x72) < 8 and abs(b - 0xB0) < 8 for _, (r, g, b) in colours)


def test_count_axes_have_whole_number_ticks(tmp_path, monkeypatch):
    """Small counts (1 and 2 records) would get ticks at 0.25, 0.5, ... without an integer locator."""
    from trajforge.pipeline.publish import report as report_module

    figures = {}
    real_save = report_module._save

    def keep(fig, out, name):
        figures[name] = fig  # _save closes the figure, but its axes stay readable
        return real_save(fig, out, name)

    monkeypatch.setattr(report_module, "_save", keep)
    small = {"sources": {"a": {"read": 2, "written": 1, "quarantined": 1, "duplicates": 0}},
             "total": {"reasons": {"malformed_json": 1, "too_long": 2}}, "negatives": {"by_type": {"x": 1}}}
    mix = {"domains": {"os": 2}, "envs": {"os": 2}}
    report_module.plot_stages(small, tmp_path)
    report_module.plot_quarantine(small, tmp_path)
    report_module.plot_negatives(small, tmp_path)
    report_module.plot_mix(mix, tmp_path)
    report_module.plot_lengths([2, 3], [4, 6], tmp_path)
    count_axes = [figures[name].axes[0].get_xticks() for name in ("stages.png", "quarantine.png", "negatives.png")]
    count_axes += [ax.get_xticks() for ax in figures["mix.png"].axes]
    turns, chars = figures["lengths.png"].axes
    count_axes += [turns.get_xticks(), turns.get_yticks(), chars.get_yticks()]
    for ticks in count_axes:
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks
