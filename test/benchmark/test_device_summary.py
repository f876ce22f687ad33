"""scripts/device/summarize.py on a soak phase: the verdict line and the soak's report in summary.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("report", [None, True, False])
def test_summary_of_a_soak_phase(tmp_path, report):
    out = tmp_path / "soak"
    out.mkdir()
    if report is not None:
        checks = {"idle": {"passed": True}, "promotions>0": {"passed": report}}
        (out / "serving_soak.json").write_text(json.dumps({"passed": report, "checks": checks}))
        (out / "serving_soak.md").write_text("# Serving soak (CUDA)\n")
    subprocess.run([sys.executable, ROOT / "scripts/device/summarize.py", "--phase", "soak", "--seconds", "500",
                    "--work", tmp_path, "--out", out], check=True, capture_output=True)
    summary = json.loads((out / "summary.json").read_text())["soak"]
    md = (out / "summary.md").read_text()
    expected = {None: "NOT RUN TO THE END", True: "PASSED", False: "FAILED (failed: promotions>0)"}[report]
    assert f"- serving soak: {expected}" in md
    assert summary["verdict"] == expected.split(" (")[0]
    assert ("# Serving soak (CUDA)" in md) == (report is not None)


def test_nameless_junit_entries_are_not_counted_as_tests(tmp_path):
    # an xdist run cut by the budget left entries with no name, which the summary had counted as passed
    sys.path.insert(0, str(ROOT / "scripts/device"))
    from summarize import outcomes

    xml = tmp_path / "junit_e2e.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="test.e2e.test_a" name="test_one" time="1.5"/>'
                   '<testcase classname="test.e2e.test_a" name="test_two" time="2"><failure message="boom"/></testcase>'
                   '<testcase time="0"/>'
                   '</testsuite></testsuites>')
    got = outcomes(xml)
    assert [(c["test"], c["outcome"]) for c in got] == [("test.e2e.test_a::test_one", "passed"),
                                                        ("test.e2e.test_a::test_two", "failed")]
