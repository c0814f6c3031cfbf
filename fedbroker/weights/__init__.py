"""What a job's model starts from and what of it trains: pinned starting weights (a safetensors file or an
earlier job's final model), frozen nodes and LoRA adapters (`plan`), reading and checking the weights
(`start`), the adapters in torch and their merge into a plain model (`adapters`)."""
