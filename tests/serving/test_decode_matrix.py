"""benchmarks/decode_matrix.py on the CPU (`--tiny`, one cell): its report, its Markdown, and
the rule's table written from the report, which `attention_plan.decode_plan` then reads."""

import json


import decode_matrix  # noqa: E402

from jax_epilog.planning import attention_plan  # noqa: E402


def test_a_tiny_matrix_and_the_table_from_it(tmp_path):
    variants = "fp8 dots heads_major,fp8 reduce heads_major_rows"
    report = decode_matrix.main(["--tiny", "--out", str(tmp_path), "--archs", "gqa",
                                 "--batches", "3", "--contexts", "33", "--variants", variants,
                                 "--rounds", "1", "--steps", "2"])
    [cell] = report["cells"]
    assert (cell["query_heads"], cell["kv_heads"], cell["batch"], cell["context"]) == (4, 2, 3, 33)
    assert list(cell["variants"]) == ["stock"] + variants.split(",")  # stock always, first
    assert all(t["seconds"] > 0 and t["steps_per_call"] == 2 for t in cell["variants"].values())
    assert report["meta"]["command"] and "commit" in report["meta"]
    written = json.loads((tmp_path / "decode_matrix.json").read_text())
    assert written["cells"] == json.loads(json.dumps(report["cells"]))
    text = (tmp_path / "decode_matrix.md").read_text()
    assert "| gqa 4/2 | 3 | 33 |" in text and "best FP8" in text
    table = tmp_path / "decode.json"
    decode_matrix.main(["--table-from", str(tmp_path / "decode_matrix.json"), "--table",
                        str(table)])
    best = attention_plan.best_fp8({v: t["seconds"] for v, t in cell["variants"].items()})
    device = report["meta"]["device"]
    assert attention_plan.decode_plan(4, 2, 3, 33, device=device, path=table)[:2] == best
    [section] = json.loads(table.read_text())["sections"]
    assert section["measured"] and section["entries"][0]["seconds"]["stock"] > 0


def test_cells_that_do_not_fit_are_skipped_and_said_so(tmp_path, monkeypatch):
    # bytes: MHA's cells need more than 85% of it, MQA's less
    monkeypatch.setattr(decode_matrix, "memory_limit", lambda: 15_000)
    report = decode_matrix.main(["--tiny", "--out", str(tmp_path), "--archs", "mha,mqa",
                                 "--batches", "1", "--contexts", "65", "--variants",
                                 "fp8 dots heads_major", "--rounds", "1", "--steps", "1"])
    mha, mqa = report["cells"]
    assert all(t["seconds"] is None and "GiB" in t["skipped"] for t in mha["variants"].values())
    assert all(t["seconds"] > 0 for t in mqa["variants"].values())
    text = (tmp_path / "decode_matrix.md").read_text()
    assert "skipped (needs about" in text and "| mqa 4/1 | 1 | 65 |" in text
    budget = decode_matrix.main(["--tiny", "--out", str(tmp_path), "--archs", "mqa",
                                 "--batches", "1", "--contexts", "33", "--budget", "0"])
    assert {t["skipped"] for t in budget["cells"][0]["variants"].values()} == {"time budget"}
