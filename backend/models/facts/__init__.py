"""What a model's files say and what a pair needs: sizes and tensor types read from the files (``model_facts.py``,
``spec_facts.py``) and memory estimates (``memory.py``)."""
