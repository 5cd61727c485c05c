"""The vLLM arm's look: a remote server that reuses prefixes only; what it reported, or why it could not run."""

from engine.public import VllmRun

from . import View, register


class VllmView(View):
    def chips(self, detail: VllmRun) -> list[str]:
        if detail.error:
            return [f"not run: {detail.error}"]
        return [f"{detail.served_model} at {detail.url}: {detail.server_cached_tokens:,} of "
                f"{detail.prompt_tokens:,} prompt tokens cached (vLLM's count, whole blocks); TTFT at the "
                "client; agreement over vLLM's top 20 first tokens"]


register(VllmView("vllm", "vLLM", "remote · reuses prefixes only", "#15803d",
                  "vLLM: sending the prompt's token ids, streaming the answer…", copy_label="KV copy"))
