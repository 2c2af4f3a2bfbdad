"""Models bigger than one device: --device-map (accelerate; layers over devices, CPU and disk offload), --max-memory
and --load-in-4bit. On a CPU, disk offload of a random model must give the greedy reply of the same model loaded on
one device, through the KV cache and tree verification; the compiled step reports such a model as unsupported;
bad combinations fail in one line before loading."""

from __future__ import annotations

import json

import pytest
import torch

from test_cli import assert_one_line_error, gen, isolated, prompt_path  # noqa: F401 (fixtures)

# llama_dir's two layers: the first on disk (loaded at each forward), the rest in memory
DISK_MAP = json.dumps({"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "disk",
                       "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "disk"})


def reply(run_cli, model, prompt, *extra):
    code, out, err = gen(run_cli, model, prompt, "--json", "--stats-file", "off", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("draft", ["none", "ngram"])
@pytest.mark.parametrize("placement", [["--device-map", DISK_MAP],
                                       ["--device-map", "auto", "--max-memory", "cpu=60KB"]],
                         ids=["json-map", "auto-max-memory"])
def test_disk_offload_gives_the_one_device_reply(run_cli, llama_dir, prompt_path, monkeypatch, draft, placement):
    """ngram drafts trees of up to 32 tokens: tree verification and the KV commit run over offloaded layers. (A fixed
    budget: the automatic one sizes trees from measured step costs, which a busy machine can make say "draft
    nothing".)"""
    plain = reply(run_cli, llama_dir, prompt_path, "--draft", draft, "-n", "48", "--tree-budget", "32")
    monkeypatch.setenv("CLOVER_COMPILE", "auto")  # the compiled step is asked for and refused, not built wrongly
    mapped = reply(run_cli, llama_dir, prompt_path, "--draft", draft, "-n", "48", "--tree-budget", "32", *placement)
    assert mapped["text"] == plain["text"] and mapped["new_tokens"] == plain["new_tokens"] == 48
    assert not mapped["compiled"] and "--device-map" in mapped["step"]
    if draft == "ngram":
        assert mapped["steps"] < 47, "drafted tokens were accepted: trees were verified"


def test_offload_with_draft_heads(run_cli, prompt_path):
    """The bundled model with its heads, half its layers on disk: the heads draft from the in-memory embedding and
    lm_head, and the reply is the one-device reply. With them offloaded too, --draft auto falls back to lookup
    and --draft clover says why in one line."""
    plain = reply(run_cli, "tiny", prompt_path, "-n", "40")
    mapped = reply(run_cli, "tiny", prompt_path, "-n", "40", "--device-map", "auto", "--max-memory", "cpu=20MB")
    assert mapped["text"] == plain["text"] and mapped["draft"] == plain["draft"] == "clover+ngram"
    everything = ["--device-map", "auto", "--max-memory", "cpu=1MB"]
    assert reply(run_cli, "tiny", prompt_path, "-n", "40", *everything)["draft"] == "ngram"
    assert_one_line_error(gen(run_cli, "tiny", prompt_path, "--draft", "clover", *everything),
                          "offloaded", "--draft ngram")


def test_compiled_step_refuses_placed_and_4bit_models(llama_dir):
    from clover_cli.step import unsupported
    from clover_cli.loading import load

    cpu = torch.device("cpu")
    plain = load(llama_dir, "cpu", "float32")
    mapped = load(llama_dir, "auto", "float32", device_map=DISK_MAP)
    assert mapped.device == cpu
    assert any(p.device.type == "meta" for p in mapped.model.parameters()), "layer 0 waits on disk"
    assert "--device-map" in unsupported(mapped.model, cpu, torch.float32, False)
    one_device = load(llama_dir, "auto", "float32", device_map=json.dumps({"": "cpu"}))
    assert unsupported(one_device.model, cpu, torch.float32, False) == unsupported(plain.model, cpu, torch.float32,
                                                                                   False)
    pytest.importorskip("bitsandbytes")
    quant = load(llama_dir, "cpu", "float32", load_in_4bit=True)
    assert "4-bit" in unsupported(quant.model, cpu, torch.float32, False)


def test_generate_4bit_on_cpu(run_cli, llama_dir, prompt_path):
    """bitsandbytes 0.50 quantizes to NF4 and runs it on a CPU."""
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.nn import Linear4bit

    code, out, err = gen(run_cli, llama_dir, prompt_path, "--load-in-4bit", "--draft", "ngram", "--json", "-n", "12",
                         "--stats-file", "off")
    assert code == 0, err
    assert err == "", "bitsandbytes' warnings must not reach the terminal"
    assert json.loads(out)["new_tokens"] == 12  # NF4 changes numerics: no comparison with the fp32 reply
    from clover_cli.loading import load

    model = load(llama_dir, "cpu", "float32", load_in_4bit=True).model
    assert isinstance(model.model.layers[0].mlp.up_proj, Linear4bit)


@pytest.mark.parametrize("args,needles", [
    (["--load-in-4bit", "--load-in-8bit"], ["--load-in-8bit", "--load-in-4bit"]),
    (["--max-memory", "cpu=1GB"], ["--max-memory", "--device-map"]),
    (["--device-map", "auto", "--device", "cpu"], ["--device-map", "--device cpu"]),
    (["--device-map", "auto", "--compile", "on"], ["--compile on", "--device-map"]),
    (["--device-map", "everywhere"], ["--device-map", "everywhere"]),
    (["--device-map", "{not json"], ["--device-map", "json"]),
    (["--device-map", "[1, 2]"], ["--device-map", "object"]),
    (["--device-map", '{"model": "gpu7"}'], ["gpu7", "not a device"]),
    (["--device-map", '{"model": 0}'], ["gpu 0", "0 gpu(s)"]),
    (["--device-map", '{"model.layers.0": "disk"}'], ["cannot load", "device"]),
    (["--device-map", "auto", "--max-memory", "cpu=lots"], ["--max-memory", "lots"]),
    (["--device-map", "auto", "--max-memory", "disk=1GB"], ["--max-memory", "disk"]),
    (["--device-map", "auto", "--max-memory", "nowhere"], ["--max-memory", "nowhere"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) and v and v[0].startswith("--") else None)
def test_bad_placement(run_cli, llama_dir, prompt_path, isolated, args, needles):
    if torch.cuda.device_count():
        pytest.skip("the GPU cases assume a machine without one")
    line = assert_one_line_error(gen(run_cli, llama_dir, prompt_path, "--draft", "none", *args), *needles,
                                 tmp=isolated)
    assert len(line) < 400


def test_device_map_from_a_file(run_cli, llama_dir, prompt_path, tmp_path):
    path = tmp_path / "map.json"
    path.write_text(DISK_MAP)
    assert (reply(run_cli, llama_dir, prompt_path, "--draft", "none", "-n", "8", "--device-map", str(path))["text"]
            == reply(run_cli, llama_dir, prompt_path, "--draft", "none", "-n", "8")["text"])
