"""kvlm: LLM inference with a KV cache in any precision, chosen per layer — from Python.

vLLM's offline API, so that a script ports by changing its import::

    from kvlm import LLM, SamplingParams

    llm = LLM(model="models/kvlm-tiny", kv_cache_dtype="fp8_per_token_head")
    outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

Beyond vLLM: ``kvlm.inspect(model, kv_cache_dtype=...)`` returns the per-layer KV plan (as
``kvlm inspect --json``), and ``kvlm.eval.perplexity(llm, text, ...)`` measures perplexity and KL
divergence against a saved run (as ``kvlm eval perplexity``).

The engine is C++ (``kvlm._core``): continuous batching, prefix caching and the CUDA kernels
run there with the GIL released; this module drives it one step at a time, so Ctrl-C stops a
batch cleanly between steps.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Union

# OpenMP's threads wait passively unless the user chose otherwise (as the kvlm binary does):
# libgomp reads this once, when _core loads it, and spinning threads cost 10-20x on a CPU
# shared with another busy process. (If torch or numpy loaded libgomp first, it is set already.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import _core  # noqa: E402
from ._core import Error  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "PoolingParams", "EmbeddingOutput",
           "EmbeddingRequestOutput", "Tokenizer", "Error", "inspect",
           "perplexity", "__version__"]
__version__ = "0.1.0"

_ids = itertools.count()


@dataclass
class SamplingParams:
    """vLLM's sampling settings (the names, defaults and meanings of vllm.SamplingParams)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        # Checked at construction, as vLLM's SamplingParams does, naming the argument.
        def bad(what):
            raise ValueError(what)
        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.")
        if not self.temperature >= 0:
            bad(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad(f"logprobs must be non-negative, got {self.logprobs}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not self.repetition_penalty > 0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")

    def _json(self, max_model_len: int, prompt_len: int) -> str:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        max_tokens = self.max_tokens if self.max_tokens is not None else max(1, max_model_len - prompt_len)
        d = {"n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
             "min_p": self.min_p, "seed": self.seed, "max_tokens": max_tokens, "min_tokens": self.min_tokens,
             "stop": stop, "stop_token_ids": list(self.stop_token_ids or []), "ignore_eos": self.ignore_eos,
             "logprobs": -1 if self.logprobs is None else self.logprobs,
             "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
             "repetition_penalty": self.repetition_penalty,
             "include_stop_str_in_output": self.include_stop_str_in_output,
             "skip_special_tokens": self.skip_special_tokens}
        return json.dumps(d)


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[List[Dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None  # "stop", "length", "abort"
    stop_reason: Union[int, str, None] = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for LLM.embed(): `dimensions` cuts a Matryoshka model's vector,
    `normalize` overrides the model's pooling configuration."""
    dimensions: Optional[int] = None
    normalize: Optional[bool] = None


@dataclass
class EmbeddingOutput:
    embedding: List[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: List[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0


class Tokenizer:
    """The model's tokenizer, as kvlm uses it (Hugging Face tokenizers' ids, jinja2's chat renderings)."""

    def __init__(self, directory: str, info: dict):
        self._e = _core.Tokenizer(directory)  # its own copy: it does not keep the LLM alive
        self.eos_token_id = info["eos_token_ids"][0] if info["eos_token_ids"] else None
        self.vocab_size = info["vocab_size"]

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self._e.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._e.decode(list(token_ids), skip_special_tokens)

    def apply_chat_template(self, conversation: List[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs: Any) -> Union[str, List[int]]:
        text = self._e.render_chat(json.dumps(conversation), add_generation_prompt, json.dumps(kwargs))
        return self._e.encode(text, False) if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}


_KNOWN_OPTIONS = {"tokenizer", "dtype", "kv_cache_dtype", "cache_type_k", "cache_type_v", "kv_cache_rotation",
                  "kv_cache_plan",
                  "kv_cache_keep_sink", "kv_cache_keep_recent",
                  "device", "max_model_len", "gpu_memory_utilization", "kv_cache_memory", "tensor_parallel_size",
                  "enable_expert_parallel",
                  "seed", "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "block_size", "quantization",
                  "dequantize_weights",
                  "enable_prefix_caching", "attention_backend", "runner", "scheduling_policy", "mamba_ssm_cache_dtype",
                  "kv_offload_gib", "kv_offload_dir", "kv_offload_disk_gib"}
_ARGUMENTS = _KNOWN_OPTIONS | {"model", "kv_cache_dtype_skip_layers", "speculative_config"}


def _python_names(message: str) -> str:
    """The engine's messages name the CLI's flags (--kv-cache-dtype); in Python they are
    arguments (kv_cache_dtype)."""
    def name(m: "re.Match[str]") -> str:
        arg = m.group(1).replace("-", "_")
        return arg if arg in _ARGUMENTS else m.group(0)
    return re.sub(r"--([a-z][a-z0-9-]*)", name, message)


def _engine_call(fn, *args):
    """fn(*args), a kvlm.Error's message in Python's argument names."""
    try:
        return fn(*args)
    except Error as e:
        raise Error(_python_names(str(e))) from None


def _options(model: str, kwargs: Dict[str, Any]) -> dict:
    o: Dict[str, Any] = {"model": os.fspath(model)}
    skip = kwargs.pop("kv_cache_dtype_skip_layers", None)
    if skip is not None:
        o["kv_cache_dtype_skip_layers"] = skip if isinstance(skip, str) else ",".join(str(x) for x in skip)
    spec = kwargs.pop("speculative_config", None)
    if spec is not None:
        o["speculative_config"] = dict(spec)
    known = _KNOWN_OPTIONS
    # vLLM options that change nothing here, accepted so that scripts run unchanged.
    ignored = {"trust_remote_code", "swap_space", "disable_log_stats", "tokenizer_mode", "revision", "load_format"}
    for k, v in kwargs.items():
        if k in ignored:
            continue
        if k not in known:
            raise ValueError(f"LLM() got an unknown option '{k}'; kvlm takes: {', '.join(sorted(known))} "
                             f"(and model, kv_cache_dtype_skip_layers, speculative_config)")
        if v is None:
            continue
        if k == "dtype" and not isinstance(v, str):
            v = str(v).replace("torch.", "")
        if k in ("tokenizer", "kv_cache_plan"):
            v = os.fspath(v)
        o[k] = v
    return o


def _progress(total: int, enabled: bool):
    if not enabled or total <= 1:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


class LLM:
    """A model loaded for offline inference (vLLM's ``LLM``): the same engine as ``kvlm serve``."""

    def __init__(self, model: str, **kwargs: Any):
        log = kwargs.pop("log_level", "warning")
        _core.set_log_level({"warning": "warn", "error": "quiet"}.get(log, log))
        seed = kwargs.get("seed")
        self._options = _options(model, dict(kwargs))
        self._engine = _engine_call(_core.Engine, json.dumps(self._options))
        self._info = json.loads(self._engine.info())
        self._seed = seed
        self._tokenizer = Tokenizer(self._engine.tokenizer_dir(), self._info) if self._engine.has_tokenizer() else None

    # -- what it is --------------------------------------------------------------------------
    @property
    def info(self) -> dict:
        """The model and its KV cache as loaded: architecture, device, KV bytes per token, capacity."""
        return dict(self._info)

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise Error("this model has no tokenizer (tokenizer.json); pass token ids instead of text")
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM does the same)."""
        p = SamplingParams()
        if self._info.get("default_temperature") is not None:
            p.temperature = self._info["default_temperature"]
        if self._info.get("default_top_p") is not None:
            p.top_p = self._info["default_top_p"]
        if self._info.get("default_top_k") is not None:
            p.top_k = self._info["default_top_k"]
        return p

    # -- generation --------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Any) -> tuple:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.get_tokenizer().encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt must be text, a list of token ids or a dict, not {type(prompt).__name__}")

    def _submit(self, prompt: Any, params: SamplingParams) -> RequestOutput:
        text, ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        rid = str(next(_ids))
        if params.seed is None and self._seed is not None:
            params = SamplingParams(**{**params.__dict__, "seed": self._seed + int(rid)})
        self._engine.add(rid, ids, params._json(self._info["max_model_len"], len(ids)))
        outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None)
                for i in range(params.n)]
        return RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids, outputs=outs)

    def _token_text(self, token_id: int) -> Optional[str]:
        """A token's own text (Logprob.decoded_token, as vLLM's): special tokens included; a
        token that is part of a UTF-8 sequence decodes to U+FFFD alone."""
        if self._tokenizer is None:
            return None
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _apply(self, r: RequestOutput, want_logprobs: bool) -> bool:
        """Applies the engine's new events to `r`; True once every choice has finished."""
        for ev in json.loads(self._engine.poll(r.request_id)):
            c = r.outputs[ev["choice"]]
            c.text += ev["text"]
            c.token_ids.extend(ev["tokens"])
            if want_logprobs and c.logprobs is not None:
                for lp in ev["logprobs"]:
                    d = {t: Logprob(v, rank=k + 1, decoded_token=self._token_text(t)) for k, (t, v) in enumerate(lp["top"])}
                    if lp["token"] not in d:
                        d[lp["token"]] = Logprob(lp["logprob"], decoded_token=self._token_text(lp["token"]))
                    c.logprobs.append(d)
                    c.cumulative_logprob = (c.cumulative_logprob or 0.0) + lp["logprob"]
            r.num_cached_tokens = ev["cached_tokens"]
            if ev["finished"]:
                if ev["finish_reason"] == "error":
                    raise Error(ev["error"] or "the engine failed on this request")
                c.finish_reason = ev["finish_reason"]
                c.stop_reason = ev["stop_reason"]
        r.finished = all(c.finish_reason is not None for c in r.outputs)
        return r.finished

    def _run(self, requests: List[RequestOutput], params: List[SamplingParams], use_tqdm: bool) -> None:
        bar = _progress(len(requests), use_tqdm)
        live = dict(enumerate(requests))
        try:
            while live:
                self._engine.step()
                for i in list(live):
                    if self._apply(live[i], params[i].logprobs is not None):
                        del live[i]
                        if bar is not None:
                            bar.update(1)
                if live and not self._engine.has_work():
                    raise Error("the engine stopped with requests unfinished")
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) or an error: the unfinished requests are aborted and
            # their pages freed before the exception goes on.
            for r in live.values():
                self._engine.abort(r.request_id)
            while self._engine.has_work():
                self._engine.step()
            for r in live.values():
                self._engine.poll(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()

    def generate(self, prompts: Union[str, Sequence[Any], Any], sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, **kwargs: Any) -> List[RequestOutput]:
        """Generates for every prompt (text, token-id lists, or {"prompt_token_ids": [...]}) at
        once through continuous batching; returns one RequestOutput per prompt, in order."""
        if "prompt_token_ids" in kwargs:  # vLLM's older keyword
            prompts = [{"prompt_token_ids": p} for p in kwargs.pop("prompt_token_ids")]
        if kwargs:
            raise ValueError(f"generate() got unknown arguments: {', '.join(kwargs)}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = []
        try:
            for p, sp in zip(prompts, params):
                requests.append(self._submit(p, sp))
        except BaseException:
            for r in requests:
                self._engine.abort(r.request_id)
            while self._engine.has_work():
                self._engine.step()
            raise
        self._run(requests, params, use_tqdm)
        return requests

    def embed(self, prompts: Union[str, Sequence[Any], Any], pooling_params: Optional[PoolingParams] = None,
              use_tqdm: bool = True) -> List[EmbeddingRequestOutput]:
        """Embeddings of every prompt (text, token-id lists, or {"prompt_token_ids": [...]}), as
        vLLM's LLM.embed(): an embedding model (runner="pooling", chosen by itself for a directory
        with sentence-transformers' modules.json) pools each prompt's final hidden states as its
        pooling configuration says."""
        if self._info.get("pooling") is None:
            raise Error("this model was loaded to generate; load it with LLM(model, runner=\"pooling\") to embed")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        ids = []
        for p in prompts:
            _, toks = self._prompt_ids(p)
            if not toks:
                raise ValueError("a prompt is empty")
            ids.append(toks)
        pp = pooling_params or PoolingParams()
        normalize = -1 if pp.normalize is None else int(bool(pp.normalize))
        vectors = _engine_call(self._engine.embed, ids, pp.dimensions or 0, normalize)
        return [EmbeddingRequestOutput(request_id=str(next(_ids)), prompt_token_ids=t, outputs=EmbeddingOutput(v))
                for t, v in zip(ids, vectors)]

    def chat(self, messages: Union[List[dict], List[List[dict]]], sampling_params: Optional[SamplingParams] = None,
             use_tqdm: bool = True, chat_template_kwargs: Optional[dict] = None, add_generation_prompt: bool = True,
             tools: Optional[list] = None) -> List[RequestOutput]:
        """Renders each conversation with the model's chat template and generates its reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = tools
        prompts = [{"prompt": tok.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      **extra)} for c in convs]
        prompts = [{"prompt": p["prompt"], "prompt_token_ids": tok.encode(p["prompt"], add_special_tokens=False)}
                   for p in prompts]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Any, sampling_params: Optional[SamplingParams] = None) -> Iterator[RequestOutput]:
        """Generates for one prompt, yielding its RequestOutput after every step that added
        text (cumulative, as vLLM's async engine does); closing the iterator aborts it."""
        params = sampling_params or self.get_default_sampling_params()
        r = self._submit(prompt, params)
        done = False
        try:
            while not done:
                self._engine.step()
                before = [len(c.token_ids) for c in r.outputs]
                done = self._apply(r, params.logprobs is not None)
                if done or [len(c.token_ids) for c in r.outputs] != before:
                    yield r
                if not done and not self._engine.has_work():
                    raise Error("the engine stopped with the request unfinished")
        finally:
            if not done:
                self._engine.abort(r.request_id)
                while self._engine.has_work():
                    self._engine.step()
                self._engine.poll(r.request_id)


def inspect(model: str, **kwargs: Any) -> List[dict]:
    """The per-layer KV plan ``LLM(model, **kwargs)`` would run with (``kvlm inspect --json``'s
    layers), without loading the weights: one dict per layer (kv_dtype, quant_mode, bytes_per_token...)."""
    return json.loads(_engine_call(_core.inspect, json.dumps(_options(model, dict(kwargs)))))


from . import eval  # noqa: E402  (kvlm.eval.perplexity; it needs LLM above)
from .eval import perplexity  # noqa: E402
