#!/usr/bin/env bash
# Install the tensorrt Python package whose version equals the TensorRT library in this image (the one
# Triton's tensorrt_plan backend loads engines with): an engine built by another version does not load.
# Tries the bindings alone first (they use the image's libnvinfer), then the full wheel. Leaves the image
# without the package, with a warning, if neither exists: the entrypoint then uses trtexec if present, or
# falls back to the torch backend (S3FLOW_FALLBACK_TO_TORCH=1).
set -euo pipefail
if python3 -c "import tensorrt" 2>/dev/null; then
    python3 -c "import tensorrt; print('tensorrt', tensorrt.__version__, 'already importable')"
    exit 0
fi
lib=$(ls /usr/lib/x86_64-linux-gnu/libnvinfer.so.* /usr/lib/aarch64-linux-gnu/libnvinfer.so.* \
         /usr/local/tensorrt/lib/libnvinfer.so.* /opt/tritonserver/backends/tensorrt/libnvinfer.so.* 2>/dev/null \
      | grep -E '\.so\.[0-9]+\.[0-9]+\.[0-9]+$' | head -n 1 || true)
if [ -z "$lib" ]; then
    echo "WARNING: no libnvinfer.so.X.Y.Z in the image; not installing the tensorrt Python package" >&2
    exit 0
fi
version=${lib##*.so.}
cuda_major=${CUDA_VERSION%%.*}
echo "image TensorRT ${version} (${lib}), CUDA ${CUDA_VERSION:-unknown}"
for pkg in "tensorrt-cu${cuda_major}-bindings==${version}.*" "tensorrt-cu${cuda_major}==${version}.*"; do
    if python3 -m pip install "$pkg" && python3 -c "import tensorrt" 2>/dev/null; then
        python3 -c "import tensorrt; print('installed tensorrt', tensorrt.__version__)"
        exit 0
    fi
done
echo "WARNING: no tensorrt Python package ${version} for CUDA ${cuda_major}; engines need trtexec or the torch backend" >&2
