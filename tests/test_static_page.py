"""The book's notebook pages (book/_ext/static_page.py): nbval's markers dropped from the code
cells, and a recorded run's "measured now ... today" given its device and date."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "book" / "_ext"))

import static_page  # noqa: E402  (the book's extension folder is not a package)


def _notebook(source, text, recorded=True):
    nb = {
        "cells": [
            {"cell_type": "markdown", "source": "# NBVAL_CHECK_OUTPUT stays in prose"},
            {
                "cell_type": "code",
                "source": source,
                "outputs": [
                    {"output_type": "stream", "name": "stdout", "text": text},
                    {"output_type": "execute_result", "data": {"text/plain": [text]}},
                ],
            },
        ],
        "metadata": {},
    }
    if recorded:
        nb["metadata"]["recorded"] = {"device": "NVIDIA H200", "date": "2026-12-01"}
    return nb


def test_nbval_marker_lines_are_dropped_wherever_they_are():
    for source, expected in [
        ("x = 1\nprint(x)\n# NBVAL_CHECK_OUTPUT", "x = 1\nprint(x)"),
        ("# NBVAL_CHECK_OUTPUT\nx = 1", "x = 1"),
        ("x = 1\n  # NBVAL_SKIP because\ny = 2\n", "x = 1\ny = 2"),
        (["x = 1\n", "# NBVAL_CHECK_OUTPUT"], "x = 1"),
        ("s = '# NBVAL_SKIP is a marker'", "s = '# NBVAL_SKIP is a marker'"),  # not a line
    ]:
        nb = static_page.for_static_page(_notebook(source, ""))
        assert nb["cells"][1]["source"] == expected, source
        assert nb["cells"][0]["source"] == "# NBVAL_CHECK_OUTPUT stays in prose"


def test_measured_now_today_gets_the_recorded_device_and_date():
    text = (
        "device: NVIDIA H200; Triton compiles for the GPU\n"
        "GPU figures: measured now on this GPU (and recorded into x.json)\n"
        "[ceilings] measured now on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, today\n"
        "[sweep] measured now on NVIDIA H200, torch 2.11.0, triton 3.6.0, 2026-11-30\n"
        "GPU figures: measured now on this GPU, 2026-11-29 (and recorded into y.json)\n"
        "the date today is not a run\n"
    )
    expected = (
        "device: NVIDIA H200; Triton compiles for the GPU\n"
        "GPU figures: measured on NVIDIA H200, 2026-12-01 (and recorded into x.json)\n"
        "[ceilings] measured on NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, 2026-12-01\n"
        "[sweep] measured on NVIDIA H200, torch 2.11.0, triton 3.6.0, 2026-11-30\n"
        "GPU figures: measured on NVIDIA H200, 2026-11-29 (and recorded into y.json)\n"
        "the date today is not a run\n"
    )
    outputs = static_page.for_static_page(_notebook("print()", text))["cells"][1]["outputs"]
    assert outputs[0]["text"] == expected
    assert outputs[1]["data"]["text/plain"] == expected


def test_a_notebook_without_a_recorded_run_says_so_rather_than_inventing_a_date():
    text = "[ceilings] measured now on NVIDIA H200, torch 2.11.0, triton 3.6.0, today\n"
    out = static_page.for_static_page(_notebook("print()", text, recorded=False))
    assert out["cells"][1]["outputs"][0]["text"] == (
        "[ceilings] measured on NVIDIA H200, torch 2.11.0, triton 3.6.0, the recorded date\n"
    )
