"""Device-specific fast paths the model runner may choose: ``cuda_graphs.py`` (static-shape forwards replayed as
CUDA graphs) and ``cpu_linear.py`` (linear layers through oneDNN with pre-packed weights).
"""
