"""The vLLM arm's look: a remote server that reuses prefixes only; what it reported, or why it could not run."""

from engine.public import URL_ENV, VllmRun, VllmSettings

from . import View, register

URL_TITLE = next(s.title for _, s in VllmSettings.declared() if s.key == "vllm_url")


class VllmView(View):
    def chips(self, detail: VllmRun) -> list[str]:
        if detail.error:
            return [f"not run: {detail.error}"]
        chips = [f"{detail.served_model} at {detail.url}: {detail.server_cached_tokens:,} of "
                 f"{detail.prompt_tokens:,} prompt tokens cached (vLLM's count, whole blocks); TTFT at the "
                 "client; agreement over vLLM's top 20 first tokens"]
        if detail.first_request:
            chips.append("cold: this studio's first request to that server; its time may hold the server's warm-up "
                         "(run it again for a warm figure)")
        return chips

    def reason(self, detail: VllmRun, error: str) -> str:
        if not detail.url:  # no server named: the field that names one
            return (f"no vLLM server given: enter its URL in “{URL_TITLE}” (vLLM: settings, beside the Arms), or "
                    f"start the studio with ${URL_ENV} set; make vllm-serve starts a server")
        return super().reason(detail, error)


register(VllmView("vllm", "vLLM", "remote · reuses prefixes only", "#15803d",
                  "vLLM: sending the prompt's token ids, streaming the answer…", copy_label="KV copy"))
