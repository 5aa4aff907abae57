"""Guided decoding: grammars compiled by xgrammar off the scheduler thread, one matcher per
request, and a per-step token mask applied just before sampling."""
