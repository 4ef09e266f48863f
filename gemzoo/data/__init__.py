"""Datasets and batching: synthetic GEM-like stream and the MovieLens ratings.dat loader."""
