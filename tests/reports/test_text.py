"""The per-layer loss chart and table, on known numbers."""

from __future__ import annotations

import io

import pytest

from layerwise.reports.text import (
    EIGHTHS,
    bar,
    block_of,
    chart_rows,
    layer_table,
    loss_chart,
    run_notes,
    supports_blocks,
    worst_layers,
)

LINEARS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def records(losses: dict[str, float | None]) -> list[dict]:
    return [{"modifier": "GPTQModifier", "name": name, "method": "gptq" if loss is not None else "rtn",
             "loss": loss, "seconds": 0.25, "samples": 64} for name, loss in losses.items()]


def big_model(blocks: int = 80) -> list[dict]:
    """``blocks`` x 7 Linears; block i's layer j has loss (i + 1) * (j + 1), one outlier in block 37."""
    losses = {f"model.layers.{i}.{name}": float((i + 1) * (j + 1)) for i in range(blocks)
              for j, name in enumerate(LINEARS)}
    if blocks > 37:
        losses["model.layers.37.mlp.down_proj"] = 10_000.0
    return records(losses)


def cells(line: str) -> float:
    """A bar's length in cells, counting eighth blocks."""
    return sum(1 if ch == EIGHTHS[-1] else (EIGHTHS.index(ch) + 1) / 8 for ch in line if ch in EIGHTHS)


def test_bar_lengths_are_proportional_to_the_loss():
    assert bar(8.0, 8.0, width=10) == EIGHTHS[-1] * 10
    assert bar(4.0, 8.0, width=10) == EIGHTHS[-1] * 5
    assert bar(1.0, 8.0, width=10) == EIGHTHS[-1] + EIGHTHS[1]  # 1.25 cells: a block and a quarter
    assert bar(1e-9, 8.0, width=10) == EIGHTHS[0]  # a loss above zero is never invisible
    assert bar(0.0, 8.0) == "" and bar(3.0, 8.0, width=8, ascii_only=True) == "###"


def test_few_layers_get_one_row_each_in_model_order():
    losses = {"model.layers.0.mlp.up_proj": 2.0, "model.layers.0.mlp.down_proj": 8.0, "lm_head": 4.0}
    lines = loss_chart(records(losses), width=16)
    assert lines[0] == "GPTQModifier loss per layer:"
    rows = lines[1:4]
    assert [row.split()[0] for row in rows] == list(losses)
    assert [cells(row) for row in rows] == [4.0, 16.0, 8.0]
    assert "2.00e+00" in rows[0] and "8.00e+00" in rows[1]


def test_the_worst_layers_are_named_worst_first():
    losses = {f"model.layers.{i}.mlp.down_proj": loss for i, loss in enumerate([3.0, 9.0, 1.0, 7.0, 5.0])}
    lines = loss_chart(records(losses), worst=3)
    worst = [line.split()[-2] for line in lines if line.startswith(("  worst:", "         "))]
    assert worst == ["model.layers.1.mlp.down_proj", "model.layers.3.mlp.down_proj", "model.layers.4.mlp.down_proj"]
    assert worst_layers(records(losses), 2) == [("model.layers.1.mlp.down_proj", 9.0),
                                                ("model.layers.3.mlp.down_proj", 7.0)]


def test_blocks_are_found_by_the_first_number_in_the_name():
    assert block_of("model.layers.3.mlp.experts.7.down_proj") == ("model.layers", 3)
    assert block_of("bert.encoder.layer.11.output.dense") == ("bert.encoder.layer", 11)
    assert block_of("lm_head") == ("lm_head", None)


def test_many_layers_are_summed_per_block():
    rows, unit = chart_rows(big_model(blocks=10), max_rows=16)
    assert unit == "block" and len(rows) == 10
    assert rows[2].label == "model.layers.2" and rows[2].layers == 7
    assert rows[2].value == sum(3 * (j + 1) for j in range(7))


def test_an_80_layer_model_stays_compact_and_still_names_its_outlier():
    lines = loss_chart(big_model(80))
    assert len(lines) <= 25
    assert lines[0].startswith("GPTQModifier loss per 5 blocks") and "560 layers" in lines[0]
    bars = [line for line in lines if line.startswith("  model.layers.")]
    assert [line.split()[0] for line in bars][:2] == ["model.layers.0-4", "model.layers.5-9"]
    assert len(bars) == 16
    worst = next(line for line in lines if line.startswith("  worst:"))
    assert "model.layers.37.mlp.down_proj" in worst and "1.00e+04" in worst
    longest = max(bars, key=cells)
    assert longest.split()[0] == "model.layers.35-39"  # the outlier's group has the longest bar


def test_stacks_are_never_merged_into_one_row():
    losses = {f"visual.blocks.{i}.mlp.fc1": 1.0 for i in range(12)}
    losses.update({f"model.layers.{i}.mlp.up_proj": 2.0 for i in range(12)})
    rows, unit = chart_rows(records(losses), max_rows=8)
    assert unit == "3 blocks"
    assert [row.label for row in rows][:4] == ["visual.blocks.0-2", "visual.blocks.3-5", "visual.blocks.6-8",
                                               "visual.blocks.9-11"]
    assert [row.label for row in rows][4:] == ["model.layers.0-2", "model.layers.3-5", "model.layers.6-8",
                                               "model.layers.9-11"]
    assert [row.value for row in rows] == [3.0] * 4 + [6.0] * 4


def test_ascii_fallback_when_the_stream_cannot_print_blocks():
    ascii_stream = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    assert not supports_blocks(ascii_stream)
    assert supports_blocks(io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    lines = loss_chart(big_model(80), ascii_only=True)
    assert all(line.isascii() for line in lines)
    assert "#" in lines[1]


def test_layers_without_a_loss_are_listed_not_drawn():
    lines = loss_chart(records({"model.layers.0.mlp.up_proj": 1.0, "model.layers.0.mlp.down_proj": None}))
    assert lines[-1] == "  no loss (rounded to nearest): model.layers.0.mlp.down_proj"
    assert sum(line.startswith("  model.layers.") for line in lines) == 1


def test_no_chart_without_losses():
    assert loss_chart([]) == []
    assert loss_chart([{"modifier": "Other", "name": "x", "note": "no loss here"}]) == []


def test_table_lists_every_layer_or_the_worst():
    recs = records({"a.0.q": 1.0, "a.0.k": 3.0, "a.0.v": None})
    table = layer_table(recs)
    assert table[0].split() == ["layer", "method", "loss", "time", "tokens"]
    assert [line.split()[0] for line in table[1:]] == ["a.0.q", "a.0.k", "a.0.v"]
    assert table[1].split()[1:] == ["gptq", "1.00e+00", "0.250", "s", "64"]
    assert [line.split()[0] for line in layer_table(recs, top=2)[1:]] == ["a.0.k", "a.0.q"]


@pytest.mark.parametrize("always", [False, True])
def test_run_notes_show_fallbacks_and_retraced_guards(always):
    assert run_notes([], [], always=always) == ([] if not always else
                                                ["fallbacks:          none", "guards re-traced:   none"])
    lines = run_notes(["sequential failed: x", "layer_sequential failed: y"], ["layers.0: mask is None"])
    assert lines == ["fallbacks:          sequential failed: x", "                    layer_sequential failed: y",
                     "guards re-traced:   layers.0: mask is None"]
