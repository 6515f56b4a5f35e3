# The two commands a newcomer needs: `make run` and `make test`. Both install what is
# missing (Debian packages), configure and build first.
BUILD     ?= build
JOBS      ?= $(shell nproc)
CMAKE_ARGS ?=
FUZZ_SECONDS ?= 60

.PHONY: all deps configure build run test fuzz release clean

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake -S . -B $(BUILD) -G Ninja $(CMAKE_ARGS) > $(BUILD).configure.log 2>&1 || \
	  (cat $(BUILD).configure.log; exit 1)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

# Generation on the CPU with the demo model (models/keel-tiny-v4, a 16M-parameter
# DeepSeek-V4-architecture model trained for keel, FP8 dense + MXFP4 experts), then its
# speed next to this machine's memory bandwidth.
PROMPT ?= It was a fine morning, and Elizabeth
run: build
	$(BUILD)/keel run --model models/keel-tiny-v4 --prompt "$(PROMPT)" --max-tokens 80 \
	  --temperature 0.8 --top-p 0.9 --seed 1
	$(BUILD)/keel bench --model models/keel-tiny-v4 --prompt 256 --decode 64

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The release build: CUDA code for every architecture keel supports (the default build
# compiles sm_80 only, which runs everywhere through the driver's JIT but slowly to start).
RELEASE_ARCHS ?= 80;86;89;90a;100a;120a
release: deps
	@cmake -S . -B $(BUILD)-release -G Ninja -DCMAKE_BUILD_TYPE=Release "-DKEEL_CUDA_ARCHS=$(RELEASE_ARCHS)" \
	  > $(BUILD)-release.configure.log 2>&1 || (cat $(BUILD)-release.configure.log; exit 1)
	cmake --build $(BUILD)-release -j $(JOBS) --target keel

# libFuzzer over the parsers, FUZZ_SECONDS each, with ASan/UBSan (clang build).
fuzz: deps
	@cmake -S . -B $(BUILD)-fuzz -G Ninja -DKEEL_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo > $(BUILD)-fuzz.configure.log 2>&1 || \
	  (cat $(BUILD)-fuzz.configure.log; exit 1)
	cmake --build $(BUILD)-fuzz -j $(JOBS)
	@for f in $(BUILD)-fuzz/fuzz_*; do \
	  name=$$(basename $$f); mkdir -p $(BUILD)-fuzz/corpus/$$name; \
	  echo "== $$name ($(FUZZ_SECONDS) s)"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	      $(BUILD)-fuzz/corpus/$$name fuzz/corpus/$$name || exit 1; \
	done

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz $(BUILD).configure.log $(BUILD)-fuzz.configure.log
