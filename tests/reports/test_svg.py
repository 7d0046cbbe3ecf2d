"""The SVG chart of per-layer loss: well-formed XML, one bar per layer, heights ordered like the losses."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from layerwise.reports.svg import NAMED_BARS, bar_heights, choose_scale, loss_svg

SVG = "{http://www.w3.org/2000/svg}"


def records(losses: dict[str, float | None]) -> list[dict]:
    return [{"name": name, "loss": loss, "seconds": 0.1, "samples": 8} for name, loss in losses.items()]


def bars(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    return [rect for rect in root.iter(f"{SVG}rect") if rect.get("class") == "bar"]


@pytest.mark.parametrize("scale", ["linear", "log"])
def test_one_bar_per_layer_with_heights_ordered_like_the_losses(scale):
    losses = {"model.layers.0.q": 0.5, "model.layers.0.k": 0.002, "model.layers.1.q": 3.0, "model.layers.1.k": 0.04}
    drawn = bars(loss_svg(records(losses), scale=scale))
    assert len(drawn) == len(losses)
    assert [rect.find(f"{SVG}title").text.split(":")[0] for rect in drawn] == list(losses)
    heights = [float(rect.get("height")) for rect in drawn]
    by_loss = sorted(range(len(losses)), key=lambda i: list(losses.values())[i])
    by_height = sorted(range(len(heights)), key=lambda i: heights[i])
    assert by_height == by_loss
    assert all(h > 0 for h in heights)
    # bars stand on one baseline
    assert len({float(r.get("y")) + float(r.get("height")) for r in drawn}) == 1


def test_linear_heights_are_proportional():
    heights, low, high = bar_heights([1.0, 2.0, 4.0], "linear", height=100)
    assert heights == [25.0, 50.0, 100.0] and (low, high) == (0.0, 4.0)


def test_log_scale_spans_whole_decades():
    heights, low, high = bar_heights([1e-4, 1e-2, 0.5], "log", height=300)
    assert (low, high) == pytest.approx((1e-4, 1.0))
    assert heights[0] == 0.0 and heights[1] == pytest.approx(150.0)


def test_auto_scale_is_log_only_when_losses_span_decades():
    assert choose_scale([1.0, 5.0, 50.0]) == "linear"
    assert choose_scale([0.001, 5.0]) == "log"
    assert choose_scale([0.001, 5.0], "linear") == "linear"
    assert "(log scale" in loss_svg(records({"a": 0.001, "b": 5.0}))


def test_names_are_escaped_and_many_bars_label_their_blocks():
    svg = loss_svg(records({"weird<&>\"name": 1.0}), title="a & b")
    assert ET.fromstring(svg) is not None and "weird&lt;&amp;&gt;" in svg
    many = {f"model.layers.{i}.mlp.{p}": float(i + 1) for i in range(25) for p in ("up", "gate", "down")}
    assert len(many) > NAMED_BARS
    root = ET.fromstring(loss_svg(records(many)))
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("transform")]
    assert labels == [f"model.layers.{i}" for i in range(25)]
    assert len(bars(loss_svg(records(many)))) == 75


def test_layers_without_a_loss_are_counted_not_drawn():
    svg = loss_svg(records({"a.0.x": 1.0, "a.0.y": None}))
    assert len(bars(svg)) == 1 and "1 layer(s) without a loss" in svg
    assert len(bars(loss_svg([]))) == 0  # still a valid document
