"""compress() writes the model card with the output; --eval measures the output and records it in the card."""

import yaml

from layerwise.cli import main


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_every_output_has_a_card_and_a_users_readme_survives_overwrite(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir", str(out),
                 "--quiet"]) == 0
    card = (out / "README.md").read_text()
    assert "compressed-tensors" in front_matter(card)["tags"]
    (out / "README.md").write_text("# my notes\n")  # the user's own card from now on
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A8", "--output-dir", str(out),
                 "--overwrite", "--quiet"]) == 0
    assert (out / "README.md").read_text() == "# my notes\n"


def test_compress_eval_records_the_measurements_in_the_card(tiny_llama_dir, tmp_path, capsys):
    text = tmp_path / "eval.txt"
    text.write_text("\n\n".join(" ".join(f"w{(i * 7 + j) % 90}" for j in range(40)) for i in range(6)))
    out = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir", str(out),
                 "--eval", str(text), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "KL" in printed and "perplexity" in printed.lower()
    assert "model-index" in front_matter((out / "README.md").read_text())
