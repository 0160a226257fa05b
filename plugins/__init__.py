"""TensorRT plugins for what standard ONNX ops cannot express well (none needed yet)."""
