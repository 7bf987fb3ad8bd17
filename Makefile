# kvlm: the two commands of the README's quick start, plus their building blocks.
#   make demo   install what is missing, build, run the bundled model (kvlm-tiny)
#   make test   install, build (CUDA sources too when nvcc exists), run every CPU test
#               under AddressSanitizer + UBSan, and short fuzzing runs of the safetensors and GGUF parsers, the request
#               parser and the grammar front ends (regex, GBNF, JSON schema)

BUILD       ?= build
ASAN_BUILD  ?= build-asan
FUZZ_BUILD  ?= build-fuzz
JOBS        ?= $(shell nproc)
FUZZ_SECONDS ?= 30
CMAKE_FLAGS ?=

.PHONY: all deps build demo test test-release test-asan fuzz clean

all: build

deps:
	@bash scripts/install-deps

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

demo: build
	@echo
	@echo "== kvlm inspect: the per-layer KV plan of the bundled model (models/kvlm-tiny) with an FP8 cache"
	./$(BUILD)/kvlm inspect --kv-cache-dtype fp8_per_token_head
	@echo
	@echo "== kvlm generate: an arithmetic word problem through the chat template, FP8 KV cache"
	./$(BUILD)/kvlm generate --chat --temperature 0 --max-tokens 100 --kv-cache-dtype fp8_per_token_head \
	  --prompt "A notebook costs 15 dollars and a candle costs 6 dollars. Selma buys 5 notebooks and 4 candles. How many dollars does Selma spend?"
	@echo
	@echo "== the same with DFlash drafting (models/kvlm-tiny-dflash, draft layer FP8 too): same text, fewer steps"
	./$(BUILD)/kvlm generate --chat --temperature 0 --max-tokens 100 --kv-cache-dtype fp8_per_token_head \
	  --speculative-config '{"method":"dflash","model":"models/kvlm-tiny-dflash","num_speculative_tokens":7}' \
	  --prompt "A notebook costs 15 dollars and a candle costs 6 dollars. Selma buys 5 notebooks and 4 candles. How many dollars does Selma spend?"
	@echo
	@echo "== kvlm generate: a pass key hidden in prose, recalled (FP8 KV cache)"
	./$(BUILD)/kvlm generate --chat --temperature 0 --max-tokens 24 --kv-cache-dtype fp8_per_token_head \
	  --prompt "$$(printf 'Read the text and remember the pass keys.\n\nIn Riverton, the bakery opens at 7 o'"'"'clock. Vera bought 12 apples at the market. It was a snowy day in Riverton. Bo is a potter and lives in Riverton.\n\nA red cart stopped near the barn. Vera wrote a letter to Bo about the river. The pass key for the tiger vault is 90577. Many people in Riverton work as a baker.\n\nWhat is the pass key for the tiger vault?')"
	@echo
	@echo "== kvlm eval task: 20 arithmetic problems, then 5 pass-key recall questions over ~1k tokens (scores of every KV precision: docs/results/accuracy.md)"
	./$(BUILD)/kvlm eval task --data models/kvlm-tiny/eval/arithmetic.jsonl --limit 20 --max-tokens 100 --kv-cache-dtype fp8_per_token_head
	./$(BUILD)/kvlm eval task --data models/kvlm-tiny/eval/recall_1k.jsonl --limit 5 --max-tokens 24 --kv-cache-dtype fp8_per_token_head

# Release build (compiles the CUDA sources when nvcc is present) + its tests, then the
# sanitizer build's tests, then the fuzzer.
test: build test-release test-asan fuzz

test-release: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLM_SANITIZE=ON -DKVLM_CUDA=OFF $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS)

fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVLM_FUZZ=ON \
	  -DKVLM_CUDA=OFF -DKVLM_TESTS=OFF $(CMAKE_FLAGS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_safetensors fuzz_gguf fuzz_request fuzz_grammar
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_safetensors $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_gguf $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_request $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_grammar $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
