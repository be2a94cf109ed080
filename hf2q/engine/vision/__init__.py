"""Vision encoders that turn image patches into the text model's input features (one module per family).

They read llama.cpp's projector file (the ``clip`` GGUF written by ``hf2q convert --mmproj``), so the
pair of files llama.cpp's ``mtmd`` tools run is also what hf2q runs.
"""
