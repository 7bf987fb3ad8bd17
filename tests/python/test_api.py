"""The Python package (python/kvlm) on the CPU: vLLM's offline API over kvlm's engine.

Run by ctest (`python_api`) with PYTHONPATH pointing at the build's python/ folder and KVLM at
the binary; the models are the bundled kvlm-tiny (a real tokenizer and chat template) and the
golden checkpoints.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvlm
from kvlm import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "models" / "kvlm-tiny")
GOLDEN = ROOT / "tests" / "golden" / "models"
KVLM = os.environ.get("KVLM", str(ROOT / "build" / "kvlm"))
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=TINY, max_model_len=512, kv_cache_memory="64MiB")


def cli_generate(*args):
    out = subprocess.run([KVLM, "generate", "--json", "--device", "cpu", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_greedy_equals_kvlm_generate(llm):
    prompt = "A notebook costs 15 dollars and a candle costs 6 dollars."
    ref = cli_generate("--model", TINY, "--prompt", prompt, "--temperature", "0", "--max-tokens", "24", "--ignore-eos")
    out = llm.generate(prompt, GREEDY)[0]
    assert out.prompt == prompt
    assert out.prompt_token_ids == ref["prompt_token_ids"]
    assert out.outputs[0].token_ids == ref["token_ids"]
    assert out.outputs[0].text == ref["text"]
    assert out.outputs[0].finish_reason == "length"
    assert out.finished


def test_batch_equals_one_at_a_time_in_order(llm):
    prompts = ["Once upon a time", "The pass key is", "A red cart stopped near the barn. Vera wrote", "Hi"]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in batch] == prompts
    for p, sp, o in zip(prompts, params, batch):
        alone = llm.generate(p, sp)[0]
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(o.outputs[0].token_ids) == sp.max_tokens


def test_token_id_prompts_and_dict_prompts(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    a = llm.generate([ids], GREEDY)[0]
    b = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    c = llm.generate("Once upon a time", GREEDY)[0]
    assert a.prompt is None and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_seeded_sampling_reproduces(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    a = llm.generate("Once upon a time", sp)[0].outputs[0].token_ids
    b = llm.generate("Once upon a time", sp)[0].outputs[0].token_ids
    c = llm.generate("Once upon a time", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=99,
                                                        ignore_eos=True))[0].outputs[0].token_ids
    assert a == b
    assert a != c
    # The same seed in a batch of other requests gives the same tokens (per-request generators).
    mixed = llm.generate(["Hello there", "Once upon a time", "The end"], [SamplingParams(temperature=1.0, max_tokens=5),
                                                                           sp, SamplingParams(temperature=1.0)])
    assert mixed[1].outputs[0].token_ids == a


def test_n_choices_and_logprobs(llm):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, logprobs=2, ignore_eos=True)
    o = llm.generate("Once upon a time", sp)[0]
    assert [c.index for c in o.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # seeds seed + i
    for c in o.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6
        for tok, lps in zip(c.token_ids, c.logprobs):
            assert tok in lps
            assert all(isinstance(v, kvlm.Logprob) and v.logprob <= 0 for v in lps.values())
            assert len(lps) in (2, 3)  # the top 2, and the sampled token when it is not among them
            # Each token's own text, as vLLM gives it.
            for t, v in lps.items():
                assert v.decoded_token == llm.get_tokenizer().decode([t], skip_special_tokens=False), (t, v)
        assert c.cumulative_logprob == pytest.approx(sum(lps[t].logprob for t, lps in zip(c.token_ids, c.logprobs)))
    assert llm.generate("Once upon a time", GREEDY)[0].outputs[0].logprobs is None


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("Once upon a time", GREEDY)[0].outputs[0]
    words = base.text.split()
    assert len(words) >= 3
    stop = words[2]
    o = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert stop not in o.text and base.text.startswith(o.text)
    tok = base.token_ids[3]
    o = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == tok
    assert o.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]


def test_tokenizer(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("A notebook costs 15 dollars.")
    assert tok.decode(ids) == "A notebook costs 15 dollars."
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert "What is 2 + 3?" in text
    assert tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True) == tok.encode(text, False)
    assert tok.eos_token_id is not None


def test_chat_renders_the_template(llm):
    msgs = [{"role": "user", "content": "A notebook costs 15 dollars. How much do 2 cost?"}]
    sp = SamplingParams(temperature=0, max_tokens=40)
    o = llm.chat(msgs, sp)[0]
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert o.prompt_token_ids == ids
    assert o.outputs[0].token_ids == llm.generate([ids], sp)[0].outputs[0].token_ids
    assert o.outputs[0].finish_reason in ("stop", "length")
    # A list of conversations: one output each, in order.
    two = llm.chat([msgs, [{"role": "user", "content": "Hi"}]], sp, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == o.outputs[0].token_ids


def test_stream_yields_growing_text_and_ends_like_generate(llm):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = [r.outputs[0].text for r in llm.stream("Once upon a time", sp)]
    assert len(seen) >= 2
    assert all(seen[i + 1].startswith(seen[i]) for i in range(len(seen) - 1))
    assert seen[-1] == llm.generate("Once upon a time", sp)[0].outputs[0].text
    # Leaving early aborts it; the engine goes on.
    it = llm.stream("Once upon a time", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(it)
    it.close()
    assert llm.generate("Hi", GREEDY)[0].finished


def test_inspect_returns_the_plan():
    layers = kvlm.inspect(TINY, kv_cache_dtype="fp8_per_token_head", kv_cache_dtype_skip_layers=[0])
    assert len(layers) == 7
    assert layers[0]["kv_dtype"] == "bfloat16" and layers[0]["dtype_source"] == "skip rule"
    assert layers[1]["kv_dtype"] == "fp8_e4m3" and layers[1]["quant_mode"] == "fp8_per_token_head"
    assert layers[1]["bytes_per_token"] < layers[0]["bytes_per_token"]
    assert all(l["bytes_per_token"] > 0 for l in layers)
    tp = kvlm.inspect(TINY, tensor_parallel_size=2)
    assert all(l["bytes_per_token_per_rank"] * 2 == l["bytes_per_token"] for l in tp)


def test_perplexity_and_kld_against_a_saved_run(tmp_path):
    text = (ROOT / "README.md").read_text()[:6000]
    base = LLM(model=TINY, kv_cache_dtype="bfloat16", kv_cache_memory="64MiB")
    r0 = kvlm.eval.perplexity(base, text, ctx=128, max_chunks=4, save_logits=tmp_path / "base.lgp")
    assert r0["ppl"] > 1 and r0["chunks"] == 4
    q = LLM(model=TINY, kv_cache_dtype="int4_per_token_head", kv_cache_memory="64MiB")
    r1 = kvlm.eval.perplexity(q, text, ctx=128, max_chunks=4, kl_divergence_base=tmp_path / "base.lgp")
    assert r1["base_ppl"] == pytest.approx(r0["ppl"])
    assert 0 < r1["kld_mean"] < 1 and 0.5 < r1["same_top"] <= 1
    assert r1["kv_bytes_per_token"] < r0["kv_bytes_per_token"]
    # The LLM generates as before afterwards (scoring resized the KV pool under it once).
    ids = q.generate("Once upon a time", GREEDY)[0].outputs[0].token_ids
    assert len(ids) == GREEDY.max_tokens
    assert ids == LLM(model=TINY, kv_cache_dtype="int4_per_token_head", kv_cache_memory="64MiB").generate(
        "Once upon a time", GREEDY)[0].outputs[0].token_ids


def test_a_kv_plan_file_runs_as_a_dtype_does(tmp_path):
    # kv_cache_plan (a path): per-layer formats, K and V apart, one side rotated with a seed; the
    # plan reaches inspect, generation and tensor parallelism, and a plan naming one dtype for
    # every layer generates what that dtype does.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kvlm_kv_plan": 1, "layers": [
        {"layer": 0, "k": "bfloat16", "v": "int4_per_token_head"},
        {"layer": 1, "k": "int8_per_token_head", "v": "int8_per_token_head", "rotation": {"k": "hadamard"},
         "rotation_seed": 7}]}))
    layers = kvlm.inspect(TINY, kv_cache_plan=plan, kv_cache_dtype="fp8_per_token_head")
    assert (layers[0]["kv_dtype"], layers[0]["v_dtype"], layers[0]["dtype_source"]) == ("bfloat16", "int4", "plan file")
    assert (layers[1]["rotation"], layers[1]["rotation_seed"]) == ("hadamard_k", 7)
    assert (layers[2]["kv_dtype"], layers[2]["dtype_source"]) == ("fp8_e4m3", "explicit")
    one = LLM(model=TINY, kv_cache_plan=plan, max_model_len=512, kv_cache_memory="64MiB")
    two = LLM(model=TINY, kv_cache_plan=str(plan), tensor_parallel_size=2, max_model_len=512, kv_cache_memory="64MiB")
    p = ["Once upon a time", "The pass key is"]
    assert [o.outputs[0].token_ids for o in one.generate(p, GREEDY)] == \
        [o.outputs[0].token_ids for o in two.generate(p, GREEDY)]
    uniform = tmp_path / "int8.json"
    uniform.write_text(json.dumps({"kvlm_kv_plan": 1, "layers": [
        {"layer": i, "k": "int8_per_token_head", "v": "int8_per_token_head"} for i in range(len(layers))]}))
    assert LLM(model=TINY, kv_cache_plan=uniform, kv_cache_memory="64MiB").generate(p, GREEDY)[0].outputs[0].token_ids == \
        LLM(model=TINY, kv_cache_dtype="int8_per_token_head", kv_cache_memory="64MiB").generate(
            p, GREEDY)[0].outputs[0].token_ids
    with pytest.raises(kvlm.Error, match="names layer 99, but the target model has layers 0..6"):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"kvlm_kv_plan": 1, "layers": [{"layer": 99}]}))
        LLM(model=TINY, kv_cache_plan=bad, kv_cache_memory="64MiB")


def test_tensor_parallel_on_the_cpu_equals_one_rank(llm):
    two = LLM(model=TINY, tensor_parallel_size=2, max_model_len=512, kv_cache_memory="64MiB")
    assert two.info["tensor_parallel_size"] == 2
    p = ["Once upon a time", "The pass key is"]
    assert [o.outputs[0].token_ids for o in two.generate(p, GREEDY)] == \
        [o.outputs[0].token_ids for o in llm.generate(p, GREEDY)]
    # Expert parallelism needs experts: refused on this dense model, in Python's names.
    with pytest.raises(kvlm.Error, match="enable_expert_parallel: .* is not a mixture of experts"):
        LLM(model=TINY, tensor_parallel_size=2, enable_expert_parallel=True, kv_cache_memory="64MiB")


def test_a_host_tier_keeps_evicted_prefixes_and_changes_no_token(llm):
    # A pool of a few sequences and kv_offload_gib: prompts over a shared prefix, more than the
    # pool holds, twice; the second round's prefixes come back from host memory, same tokens.
    tiered = LLM(model=TINY, max_model_len=256, kv_cache_memory="1MiB", kv_offload_gib=0.05, max_num_seqs=2)
    assert "host tier (--kv-offload-gib)" in tiered.info["summary"], tiered.info["summary"]
    shared = "A red cart stopped near the barn and the farmer unloaded the apples one by one. "
    prompts = [shared + tail for tail in ["Vera wrote", "Tom said", "The dog ran", "Anna gave", "It rained", "Hi"]]
    first = [o.outputs[0].token_ids for o in tiered.generate(prompts, GREEDY, use_tqdm=False)]
    second = [o.outputs[0].token_ids for o in tiered.generate(prompts, GREEDY, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert first == want and second == want
    with pytest.raises(ValueError, match="kv_offload_gib keeps the pages the prefix cache evicts"):
        LLM(model=TINY, kv_offload_gib=0.05, enable_prefix_caching=False, kv_cache_memory="1MiB", max_model_len=256)


def test_a_disk_tier_keeps_prefixes_for_the_next_engine(llm, tmp_path):
    # kv_offload_dir: an engine that stops leaves its cached pages on disk; the next one on the
    # same model and directory reads them back (the directory holds them), same tokens.
    import gc
    kw = dict(model=TINY, max_model_len=256, kv_cache_memory="1MiB", kv_offload_gib=0.01, max_num_seqs=2,
              kv_offload_dir=str(tmp_path), kv_offload_disk_gib=0.1)
    prompts = ["The farmer unloaded the apples one by one and " + tail for tail in ["Vera wrote", "Tom said", "Hi"]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    first = LLM(**kw)
    assert "disk tier (--kv-offload-disk-gib)" in first.info["summary"], first.info["summary"]
    assert [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)] == want
    del first
    gc.collect()
    assert list(tmp_path.glob("*/*.kvpage")), "the stopped engine left no pages on disk"
    second = LLM(**kw)
    assert [o.outputs[0].token_ids for o in second.generate(prompts, GREEDY, use_tqdm=False)] == want
    del second
    gc.collect()
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_offload_disk_gib"):
        LLM(model=TINY, kv_offload_gib=0.05, kv_offload_dir=str(tmp_path), kv_cache_memory="1MiB", max_model_len=256)


def test_the_default_pool_fits_the_model_and_max_model_len():
    # No kv_cache_memory on the CPU: 16 sequences of max_model_len (the server's default), not
    # 4 GiB for an 11.7M-parameter model (7-16 s to start).
    t0 = time.time()
    small = LLM(model=TINY, max_model_len=256)
    took = time.time() - t0
    info = small.info
    assert info["kv_cache_tokens"] == 16 * 256, info["summary"]
    assert "the CPU default: 16 sequences of --max-model-len" in info["summary"], info["summary"]
    assert small.generate("Hi", GREEDY)[0].finished
    full = LLM(model=TINY)  # the model's whole context
    assert full.info["kv_cache_tokens"] == 16 * full.info["max_model_len"], full.info["summary"]
    assert full.info["kv_cache_tokens"] * full.info["kv_bytes_per_token"] < 4 << 30
    print(f"LLM(kvlm-tiny, max_model_len=256) loaded in {took:.2f} s")


def test_bad_arguments_raise_value_errors_with_the_cli_messages(llm):
    # The CLI's messages, in Python's argument names (kv_cache_dtype, not --kv-cache-dtype).
    with pytest.raises(ValueError, match="invalid kv_cache_dtype 'fp9'") as e:
        LLM(model=TINY, kv_cache_dtype="fp9")
    assert "--" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="block_size") as e:
        LLM(model=TINY, block_size=3)
    assert "--block-size" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="unknown option 'kv_cache_type'"):
        LLM(model=TINY, kv_cache_type="fp8")
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/no/such/model")
    with pytest.raises(kvlm.Error, match="tensor_parallel_size 4 cannot split this model"):
        LLM(model=TINY, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="top-p|top_p"):
        llm.generate("Hi", SamplingParams(top_p=0))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        llm.generate("Hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="maximum context length|exceeds"):
        llm.generate("Hi " * 600, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the model's vocabulary|outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="a prompt must be"):
        llm.generate([3.5], GREEDY)
    assert issubclass(kvlm.Error, ValueError)
    # Nothing was left behind: the engine serves the next request.
    assert llm.generate("Hi", GREEDY)[0].finished


def test_keyboard_interrupt_stops_a_batch_cleanly(llm):
    # SIGINT while a long batch runs: KeyboardInterrupt comes out of generate() between two
    # steps, the unfinished requests are aborted, and the engine serves the next call.
    prompts = [f"Story number {i}:" for i in range(16)]
    sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, sp, use_tqdm=False)
    assert time.time() - t0 < 60
    timer.cancel()
    assert llm.generate("Hi", GREEDY)[0].outputs[0].token_ids == llm.generate("Hi", GREEDY)[0].outputs[0].token_ids


def test_golden_models_greedy_equals_kvlm_generate():
    for name in ("llama-gqa", "gemma3-swa", "qwen2-bias"):
        model = GOLDEN / name
        ids = [1, 5, 9, 14, 20]
        ref = cli_generate("--model", str(model), "--prompt-ids", ",".join(map(str, ids)), "--temperature", "0",
                           "--max-tokens", "12", "--ignore-eos")
        out = LLM(model=str(model), kv_cache_memory="16MiB").generate([ids], SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == ref["token_ids"], name


def test_a_vllm_script_runs_with_only_the_import_changed(tmp_path):
    src = (Path(__file__).parent / "vllm_script.py").read_text()
    assert "from vllm import LLM, SamplingParams" in src
    ported = src.replace("from vllm import LLM, SamplingParams", "from kvlm import LLM, SamplingParams")
    script = tmp_path / "ported.py"
    script.write_text(ported)
    out = subprocess.run([sys.executable, str(script), TINY], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "ok: 3 prompts" in out.stdout


def test_sampling_params_are_checked_at_construction():
    # As vLLM's: a bad value is a ValueError naming the argument, before any request runs.
    for kwargs, name in [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                         ({"n": 0}, "n"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
                         ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
                         ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
                         ({"presence_penalty": 3.0}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=None)  # the edges are fine


def test_the_first_example_of_docs_python_md_answers(tmp_path):
    # docs/python.md opens with an example on the bundled model: it runs as written (from the
    # repository's root) and prints exactly what the comments under its print() show.
    doc = (ROOT / "docs" / "python.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    shown = code[code.rindex("print("):].splitlines()[1:]
    want = [l[2:] for l in shown if l.startswith("# ")]
    assert len(want) >= 2, code
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == want, out.stdout


def test_embed_equals_transformers_and_shares_the_cli_defaults():
    # The golden embedding model (Qwen3-Embedding's layout): runner auto finds modules.json.
    embed = ROOT / "tests" / "golden" / "embed"
    golden = json.loads((embed / "expected.json").read_text())
    e = LLM(model=str(embed / "model"), dtype="float32", kv_cache_memory="16MiB")
    assert e.info["pooling"]["type"] == "last" and e.info["pooling"]["matryoshka"]
    inputs = [g["ids"] for g in golden["inputs"]]
    outs = e.embed([{"prompt_token_ids": ids} for ids in inputs])
    for out, g in zip(outs, golden["inputs"]):
        assert max(abs(a - b) for a, b in zip(out.outputs.embedding, g["last"])) < 2e-5
    cut = e.embed(inputs[2], pooling_params=kvlm.PoolingParams(dimensions=16))[0].outputs.embedding
    assert max(abs(a - b) for a, b in zip(cut, golden["inputs"][2]["last16"])) < 2e-5
    raw = e.embed(inputs[1], pooling_params=kvlm.PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(sum(x * x for x in raw) ** 0.5 - 1) > 0.1
    with pytest.raises(kvlm.Error, match="between 1 and the model's 64"):
        e.embed(inputs[0], pooling_params=kvlm.PoolingParams(dimensions=65))
    with pytest.raises(kvlm.Error, match="embedding model"):
        e.generate({"prompt_token_ids": [1, 2]}, GREEDY)
    # One set of defaults and checks with the CLI (engine/engine_args.h), named as Python names them.
    with pytest.raises(kvlm.Error, match="scheduling_policy must be fcfs or priority"):
        LLM(model=str(embed / "model"), scheduling_policy="lottery")
    with pytest.raises(kvlm.Error, match="kv_cache_keep_sink"):
        LLM(model=str(embed / "model"), kv_cache_keep_sink=-1)


def test_embed_refuses_a_generative_model(llm):
    with pytest.raises(kvlm.Error, match='runner="pooling"'):
        llm.embed("hello")
