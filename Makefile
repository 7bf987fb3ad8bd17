# kvlm: the two commands of the README's quick start, plus their building blocks.
#   make demo   install what is missing, build the binary, run scripts/demo on the bundled
#               model (kvlm-tiny): its KV cache in bf16, FP8 and INT4 side by side, drafting
#   make test   install, build (CUDA sources too when nvcc exists), run every CPU test
#               under AddressSanitizer + UBSan, and short fuzzing runs of the safetensors and GGUF parsers, the request
#               parser and the grammar front ends (regex, GBNF, JSON schema)

BUILD       ?= build
ASAN_BUILD  ?= build-asan
FUZZ_BUILD  ?= build-fuzz
JOBS        ?= $(shell nproc)
FUZZ_SECONDS ?= 30
CMAKE_FLAGS ?=
# ctest runs $(JOBS) tests at once: each gets its share of the cores as OpenMP threads. Two
# tests of two threads each on two cores run 4-5x slower than with one thread each (the
# fork-join of every linear waits for a descheduled thread; docs/results/contention.md).
OMP_PER_TEST ?= $(shell n=$$(nproc); j=$(JOBS); echo $$(( n / j > 1 ? n / j : 1 )))
CTEST = OMP_NUM_THREADS=$(OMP_PER_TEST) ctest --output-on-failure -j $(JOBS)
# The sanitizer and fuzzer builds compile at -O1 with line tables only: half the compile
# time of -O2 -g (measured on the largest sources), and their reports still name file:line.
SAN_CMAKE_FLAGS = -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"

.PHONY: all deps build build-test demo test test-release test-asan fuzz clean

all: build

deps:
	@bash scripts/install-deps

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# `make test` compiles the CUDA sources wherever nvcc exists, GPU or not (CI checks that they
# compile); `make demo` and `make build` leave that to CMake's default (a visible GPU).
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
TEST_CMAKE_FLAGS := $(if $(NVCC),-DKVLM_CUDA=ON,)

build-test: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVLM_TESTS=ON $(TEST_CMAKE_FLAGS) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

# The demo builds the binary alone (a minute or two on 2 cores; CUDA only where a GPU is
# visible) and runs scripts/demo: one question with a bf16, FP8 and INT4 KV cache side by side,
# bytes per token, tokens that fit and KL divergence from bf16, then DFlash drafting.
demo:
	@bash scripts/install-deps --build
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS) --target kvlm
	@bash scripts/demo $(BUILD)/kvlm

# Release build (compiles the CUDA sources when nvcc is present) + its tests, then the
# sanitizer build's tests, then the fuzzer.
test: build-test test-release test-asan fuzz

test-release: build-test
	cd $(BUILD) && $(CTEST)

test-asan: deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja $(SAN_CMAKE_FLAGS) -DKVLM_SANITIZE=ON -DKVLM_CUDA=OFF -DKVLM_TESTS=ON $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j $(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(CTEST)

fuzz: deps
	CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -G Ninja $(SAN_CMAKE_FLAGS) -DKVLM_FUZZ=ON \
	  -DKVLM_CUDA=OFF -DKVLM_TESTS=OFF $(CMAKE_FLAGS)
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_safetensors fuzz_gguf fuzz_request fuzz_grammar
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_safetensors $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_gguf $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_request $(FUZZ_SECONDS)
	bash fuzz/run.sh $(FUZZ_BUILD)/fuzz/fuzz_grammar $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
