"""The runtime layer: the estimator, encoder and vocoder on a backend (ONNX export, ONNX Runtime, TensorRT,
torch on a device). Imports the model layer and ``s3flow.contract`` only."""
