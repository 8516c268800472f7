"""The runtime layer: the estimator, encoder and vocoder on a backend (ONNX export, ONNX Runtime, TensorRT,
torch on a device). Imports the model layer, ``s3flow_contract.tensors`` and ``s3flow.protocol`` only."""
