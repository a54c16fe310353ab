# `make run` and `make test` set everything up on a fresh machine: a .venv with the project installed.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --editable '.[dev]'
	touch $@

# The DP kernels compiled into numba's cache (beside their source): a first solve loads them instead of
# compiling for 20-30 s.
KERNELS := strategies/__pycache__/.kernels-compiled
$(KERNELS): strategies/dp_kernels.py strategies/compile_kernels.py $(VENV)/.installed
	$(PY) -m strategies.compile_kernels
	touch $@

# The packages a GPU node without a registry lacks beside its torch, torchvision, timm, numba, pandas,
# matplotlib and nvidia-ml-py (configs/README.md: a GPU node without a registry), as wheels for Python 3.12 on x86-64.
WHEELS := .whl
$(WHEELS)/.ready:
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d $(WHEELS) \
		hydra-core==1.3.2 omegaconf==2.3.0 segmentation-models-pytorch==0.6.0 tabulate==0.10.0 highspy==1.16.0
	python3 -m pip wheel --quiet --no-deps -w $(WHEELS) antlr4-python3-runtime==4.9.3  # a source release only
	touch $@

.PHONY: run test wheels
wheels: $(WHEELS)/.ready

run: $(VENV)/.installed $(KERNELS)
	$(PY) -m harness +net=resnet50 +strategy=vanilla

# One worker per core, at most four (each holds a few GB); a file's tests share a worker, and its caches.
test: $(VENV)/.installed $(KERNELS)
	$(PY) -m pytest -n auto --maxprocesses 4 --dist loadfile
