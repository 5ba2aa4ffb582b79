"""Model resolution and weight loading: HF directories (sharded too), GGUF via the cache,
presets with dummy weights, and clear errors naming ``model``."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import engine.loading.gguf
import engine.model_source
from engine.runner.attention import PagedAttentionBackend
from engine.runner.kv_cache import KVCache
from engine.loading.loader import load_model
from engine.loading.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.loading.presets import PRESETS
from tests.helpers.models import hf_greedy
from tests.helpers.models import ATOL, TINY, PagedRunner, hf_logits, make_hf_model, tokens


@pytest.fixture()
def tiny_dir(tmp_path):
    hf = make_hf_model(transformers.LlamaConfig, {})
    hf.save_pretrained(tmp_path)
    return hf, tmp_path


def test_sharded_checkpoint_matches_hf(tmp_path):
    hf = make_hf_model(transformers.Qwen2Config, {})
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    prompt = tokens(9, 0)
    (out,) = PagedRunner(load_model(str(tmp_path)).model).step([(0, prompt)])
    torch.testing.assert_close(out, hf_logits(hf, prompt), atol=ATOL, rtol=ATOL)


def test_missing_tensor_rejected(tiny_dir):
    _, path = tiny_dir
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model=.*k_proj"):
        load_model(str(path))


def test_unexpected_tensor_rejected(tiny_dir):
    _, path = tiny_dir
    state = load_file(path / "model.safetensors")
    state["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(TINY["intermediate_size"])
    save_file(state, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model=.*gate_proj.bias"):
        load_model(str(path))


def test_tokenizer_and_merged_eos_ids(tiny_dir):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    _, path = tiny_dir
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "<|end|>": 7}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>").save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = load_model(str(path))
    assert loaded.config.eos_token_id == [2, 5, 7]
    assert loaded.tokenizer.encode("hello world", add_special_tokens=False) == [3, 4]
    assert loaded.model_id == path.name


def test_dummy_smollm2_preset_runs():
    loaded = load_model("smollm2-135m", load_format="dummy")
    assert loaded.tokenizer is None and loaded.path is None
    assert loaded.config.num_hidden_layers == 30 and loaded.config.vocab_size == 49152
    runner = PagedRunner(loaded.model, block_size=16, num_blocks=4)
    (prefill,) = runner.step([(0, [1, 2, 3, 4, 5])])
    (decode,) = runner.step([(0, [6])])
    assert prefill.shape == (5, 49152) and decode.shape == (1, 49152)
    assert torch.isfinite(prefill).all() and torch.isfinite(decode).all()


def test_llama_3_8b_preset_has_real_shapes():
    config = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"])
    with torch.device("meta"):  # 16 GB in bf16: count it, never allocate it
        model = LlamaForCausalLM(config, PagedAttentionBackend())
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert config.head_dim == 128 and config.num_queries_per_kv == 4
    assert KVCache.bytes_per_block(config, 16, torch.bfloat16) == 2 * 1024 * 1024


def test_config_dict_dummy_in_bfloat16():
    cfg = {"model_type": "qwen3", **TINY}
    loaded = load_model(cfg, dtype="bfloat16", load_format="dummy")
    assert loaded.model_id == load_model(dict(cfg), load_format="dummy").model_id
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    (out,) = PagedRunner(loaded.model).step([(0, tokens(6, 1))])
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(
    "model", ["no-such-preset", "/nonexistent/model/dir", "./missing.gguf", "tandem-tests/no-such-repo"]
)
def test_unknown_model_rejected(model):
    with pytest.raises(ValueError, match="model="):
        load_model(model)


def test_bad_arguments_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="model="):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="model=.*load_format='dummy'"):
        load_model("smollm2-135m")
    with pytest.raises(ValueError, match="load_format="):
        load_model("smollm2-135m", load_format="pt")
    with pytest.raises(ValueError, match="dtype="):
        load_model("smollm2-135m", dtype=torch.int8, load_format="dummy")


def test_gguf_conversion_is_cached_and_race_safe(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    stat = gguf.stat()
    final = tmp_path / "cache" / f"tiny-{stat.st_size}-{stat.st_mtime_ns}-{engine.model_source.GGUF_DIR_FORMAT}"
    calls = []

    def convert_while_another_process_wins(path, out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(engine.loading.gguf, "_write_hf_dir", convert_while_another_process_wins)
    assert engine.loading.gguf.convert(gguf) == final
    assert json.loads((final / "config.json").read_text()) == {"winner": True}
    assert sorted(os.listdir(tmp_path / "cache")) == [final.name, f"{final.name}.lock"]  # our temp copy is gone
    assert engine.loading.gguf.convert(gguf) == final and len(calls) == 1  # cache hit


def test_processes_missing_the_cache_at_once_convert_a_gguf_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []

    def slow_convert(path, out):
        calls.append(out)
        time.sleep(0.5)  # the others arrive while this one converts
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(engine.loading.gguf, "_write_hf_dir", slow_convert)
    with ThreadPoolExecutor(3) as pool:  # each call its own lock file handle, as separate processes have
        targets = list(pool.map(lambda _: engine.loading.gguf.convert(gguf), range(3)))
    assert len(set(targets)) == 1 and (targets[0] / "config.json").is_file()
    assert len(calls) == 1


@pytest.mark.slow
def test_default_model_is_smollm2_and_matches_hf_gguf(hf_model, tmp_path, monkeypatch):
    """``load_model(None)`` converts the shipped GGUF once and agrees with transformers
    reading the same GGUF: logits on a chat prompt, and greedy decode through the paged cache."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    loaded = load_model(None)
    assert loaded.config.num_hidden_layers == 30 and loaded.config.vocab_size == 49152
    assert loaded.model_id == "SmolLM2-135M-Instruct.Q4_1" and 2 in loaded.config.eos_token_id
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.tokenizer.render_chat(messages)
    ids = loaded.tokenizer.apply_chat_template(messages)
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == prompt

    hf, hf_tokenizer = hf_model
    assert hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == prompt
    assert hf_tokenizer.encode(prompt, add_special_tokens=False) == ids
    for text in ("Hello world", "  spaces, émojis 🙂 and\nnewlines", "<|im_start|>user"):
        assert loaded.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=True), text
    runner = PagedRunner(loaded.model, block_size=16)
    (out,) = runner.step([(0, ids)])
    torch.testing.assert_close(out, hf_logits(hf, ids), atol=5e-4, rtol=1e-4)
    greedy = []
    for _ in range(8):
        greedy.append(int(out[-1].argmax()))
        (out,) = runner.step([(0, greedy[-1:])])
    assert greedy == hf_greedy(hf, ids, max_new_tokens=8)
    assert "Paris" in loaded.tokenizer.decode(greedy)

    monkeypatch.setattr(engine.model_source.subprocess, "run", None)  # a second load must not convert
    assert load_model(None, load_format="dummy").path == loaded.path
