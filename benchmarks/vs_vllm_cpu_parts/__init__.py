"""The parts of benchmarks/vs_vllm_cpu.py (the script keeps the CLI and the runs)."""
