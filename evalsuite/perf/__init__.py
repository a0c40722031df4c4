"""Speed: routing traces, model shapes, hardware profiles, the TPOT simulator and the benchmark."""
