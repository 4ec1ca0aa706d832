"""Drafters propose tokens for the target to verify: prompt lookup (n-gram) and a small draft model."""
