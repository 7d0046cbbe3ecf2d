"""`layerwise plugins --check`: the plugin kit on every installed patch, as a table and as JSON."""

from __future__ import annotations

import json

import pytest

from layerwise.cli import main
from layerwise.errors import UnknownNameError
from layerwise.testing.support_matrix import COLUMNS, check_patches, format_matrix

#: a third-party distribution with a working Llama-layout patch, one with a typo in its ignore
#: list, and one without tiny models
THIRD_PARTY = '''
import dataclasses

from layerwise import hookimpl
from layerwise.model_zoo.llama import LLAMA

GOOD = dataclasses.replace(LLAMA, name="acme-llama", architectures=("AcmeForCausalLM",), model_types=())
TYPO = dataclasses.replace(GOOD, name="acme-typo", ignore=("lm_haed",))
BARE = dataclasses.replace(GOOD, name="acme-bare", tiny_models=())

@hookimpl
def layerwise_register_model_patches(register):
    register(GOOD)
    register(TYPO)
    register(BARE)
'''


@pytest.fixture
def acme(fake_dist):
    fake_dist("layerwise-acme", "0.2.0", entry_points={"acme": "lw_acme"}, files={"lw_acme.py": THIRD_PARTY})


def test_a_third_party_patch_is_checked_like_the_zoo_and_failures_name_the_problem(acme):
    rows = {row.patch: row for row in check_patches(["layerwise-acme"])}
    assert set(rows) == {"acme-llama", "acme-typo", "acme-bare"}
    good, typo, bare = rows["acme-llama"], rows["acme-typo"], rows["acme-bare"]
    assert good.passed and list(good.checks) == list(COLUMNS) and good.modalities == ["text"]
    assert (good.distribution, good.version, good.architecture) == ("layerwise-acme", "0.2.0", "LlamaForCausalLM")
    assert not typo.passed and typo.checks["ignore"] == "failed" and typo.checks["GPTQ"] == "passed"
    assert "ignore entry 'lm_haed' match no module" in typo.failures[0]
    assert not bare.passed and "lists no tiny_models" in bare.failures[0]
    table = format_matrix(list(rows.values()), times=False)
    assert "1 of 3 tiny models pass every check" in table
    assert "✘ acme-typo / tiny_llama: check_model_patch(acme-typo): ignore:" in table


def test_cli_prints_the_matrix_and_exits_1_on_a_failure(acme, capsys):
    assert main(["plugins", "--check", "acme-llama"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:5] == ["patch", "model", "architecture", "distribution", "modalities"]
    assert "acme-llama  tiny_llama" in out and "1 of 1 tiny models pass every check" in out
    assert main(["plugins", "--check", "acme-typo", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["columns"] == list(COLUMNS) and report["summary"] == {"models": 1, "passed": 0}
    (row,) = report["rows"]
    assert row["checks"]["ignore"] == "failed" and row["passed"] is False and row["failures"]


def test_an_unknown_name_is_an_error_listing_the_installed_patches():
    with pytest.raises(UnknownNameError, match=r"unknown model patch 'lama'.*did you mean 'llama'.*valid model "
                                               r"patches: .*bert"):
        check_patches(["lama"])
