"""Precision transforms (issue 4): autocast and half."""
