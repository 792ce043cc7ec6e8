"""heterps_ray.metrics: what a run reports to the tools users already open (TensorBoard, MLflow)."""
