"""Architecture families: HF checkpoint layout → llama.cpp tensor names and metadata (one file each)."""
