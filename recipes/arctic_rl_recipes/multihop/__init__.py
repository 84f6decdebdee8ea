"""Multi-hop QA: HotpotQA/MuSiQue/2WikiMultihopQA loaders, a synthetic generator, substring-match reward."""
