"""A batch job written against vLLM's offline API (it runs under vLLM as it is). The Python
package's test runs it with only its import changed to kvlm.

usage: python vllm_script.py MODEL_DIR
"""
import sys

from vllm import LLM, SamplingParams

model = sys.argv[1]
llm = LLM(model=model, dtype="auto", max_model_len=512, gpu_memory_utilization=0.5, seed=0)

prompts = ["Once upon a time", "The capital of the kingdom was", "A notebook costs 15 dollars and"]
greedy = SamplingParams(temperature=0.0, max_tokens=16)
outputs = llm.generate(prompts, greedy)
for out in outputs:
    assert out.prompt in prompts
    assert len(out.prompt_token_ids) > 0
    completion = out.outputs[0]
    assert isinstance(completion.text, str) and len(completion.token_ids) <= 16
    assert completion.finish_reason in ("stop", "length")
    print(f"{out.prompt!r} -> {completion.text!r}")

# Sampling with several choices, top-k / top-p / min-p, penalties, stop strings and logprobs.
params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=7, max_tokens=12,
                        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, stop=["\n\n"],
                        logprobs=1)
sampled = llm.generate(prompts[0], params)[0]
assert len(sampled.outputs) == 2
for c in sampled.outputs:
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)

# Token ids in, and the chat interface.
ids = llm.get_tokenizer().encode("Once upon a time")
by_ids = llm.generate([{"prompt_token_ids": ids}], greedy)[0]
assert by_ids.outputs[0].token_ids == outputs[0].outputs[0].token_ids
reply = llm.chat([{"role": "user", "content": "How much do 2 notebooks cost?"}], greedy)[0]
print("chat:", repr(reply.outputs[0].text))
print(f"ok: {len(outputs)} prompts")
