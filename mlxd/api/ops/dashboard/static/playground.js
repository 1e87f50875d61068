// The playground goes through the public OpenAI routes, exactly as a client would.

import { call, explain, fetchOk, sse } from "./api.js";

const $ = (id) => document.getElementById(id);

export function setupPlayground() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    chat();
  });
  $("embed-form").addEventListener("submit", (event) => {
    event.preventDefault();
    embed();
  });
  $("transcribe-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("transcribe-file").files[0];
    if (file) transcribe(file, file.name);
    else $("transcribe-stats").textContent = "Choose an audio file, or record one.";
  });
  $("transcribe-record").addEventListener("click", record);
  $("speak-form").addEventListener("submit", (event) => {
    event.preventDefault();
    speak();
  });
}

// A speech model's voices (from /v1/status) in the voice select.
export function fillVoices(models) {
  const chosen = $("speak-model").value;
  const model = Object.entries(models).find(([n, m]) => n === chosen || (m.aliases || []).includes(chosen));
  fillModels($("speak-voice"), model?.[1].voices || []);
}

// Keep each select's choice while the list of models changes under it.
export function fillModels(select, ids) {
  const current = select.value;
  const same = ids.length === select.options.length && ids.every((id, i) => select.options[i].value === id);
  if (same) return;
  select.replaceChildren(...ids.map((id) => new Option(id, id)));
  if (ids.includes(current)) select.value = current;
}

async function chat() {
  const reply = $("chat-reply"), stats = $("chat-stats"), button = $("chat-send");
  reply.textContent = "";
  stats.textContent = "waiting for the first token…";
  button.disabled = true;
  const started = performance.now();
  let first = null, chunks = 0, usage = null;
  try {
    const body = {
      model: $("chat-model").value,
      messages: [{ role: "user", content: $("chat-message").value }],
      stream: true,
      stream_options: { include_usage: true },
    };
    for await (const data of sse("/v1/chat/completions", { method: "POST", body })) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const text = chunk.choices?.[0]?.delta?.content;
      if (!text) continue;
      first ??= performance.now();
      chunks += 1;
      reply.textContent += text;
      stats.textContent = `TTFT ${((first - started) / 1000).toFixed(2)} s · ${chunks} tokens`;
    }
    const tokens = usage?.completion_tokens ?? chunks;
    const ttft = first === null ? null : (first - started) / 1000;
    const decode = first === null ? 0 : (performance.now() - first) / 1000;
    stats.textContent = ttft === null
      ? "no tokens"
      : `TTFT ${ttft.toFixed(2)} s · ${tokens} tokens · ${decode > 0 ? ((tokens - 1) / decode).toFixed(1) : "–"} tok/s`;
  } catch (error) {
    stats.textContent = `Refused: ${explain(error)}`;
  } finally {
    button.disabled = false;
  }
}

function cosine(a, b) {
  let dot = 0, na = 0, nb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return dot / Math.sqrt(na * nb);
}

async function embed() {
  const result = $("embed-result");
  result.textContent = "…";
  try {
    const body = { model: $("embed-model").value, input: [$("embed-a").value, $("embed-b").value] };
    const { data } = await call("/v1/embeddings", { method: "POST", body });
    const [a, b] = data.sort((p, q) => p.index - q.index).map((d) => d.embedding);
    result.textContent = `Cosine similarity: ${cosine(a, b).toFixed(4)}`;
  } catch (error) {
    result.textContent = `Refused: ${explain(error)}`;
  }
}

async function transcribe(blob, name) {
  const reply = $("transcribe-reply"), stats = $("transcribe-stats"), button = $("transcribe-send");
  reply.textContent = "";
  stats.textContent = "transcribing…";
  button.disabled = true;
  const started = performance.now();
  try {
    const form = new FormData();
    form.append("model", $("transcribe-model").value);
    form.append("file", blob, name);
    form.append("response_format", "verbose_json");
    const response = await fetchOk("/v1/audio/transcriptions", { form });
    const result = await response.json();
    reply.textContent = result.text;
    const seconds = (performance.now() - started) / 1000;
    stats.textContent = `${result.duration.toFixed(1)} s of ${result.language} audio in ${seconds.toFixed(1)} s`;
  } catch (error) {
    stats.textContent = `Refused: ${explain(error)}`;
  } finally {
    button.disabled = false;
  }
}

let recorder = null;
async function record() {
  const button = $("transcribe-record");
  if (recorder) {
    recorder.stop();
    return;
  }
  try {
    const stream = await navigator.mediaDevices.getUserMedia({ audio: true });
    const chunks = [];
    recorder = new MediaRecorder(stream);
    recorder.ondataavailable = (event) => chunks.push(event.data);
    recorder.onstop = () => {
      stream.getTracks().forEach((track) => track.stop());
      recorder = null;
      button.textContent = "Record";
      transcribe(new Blob(chunks, { type: chunks[0]?.type || "audio/webm" }), "recording.webm");
    };
    recorder.start();
    button.textContent = "Stop";
  } catch (error) {
    $("transcribe-stats").textContent = `Cannot record: ${error.message} (browsers allow it on https or localhost)`;
  }
}

async function speak() {
  const stats = $("speak-stats"), button = $("speak-send"), audio = $("speak-audio");
  stats.textContent = "speaking…";
  button.disabled = true;
  const started = performance.now();
  try {
    const body = {
      model: $("speak-model").value,
      voice: $("speak-voice").value || "alloy",  // none listed yet (not loaded): audio.voice
      input: $("speak-text").value,
      response_format: "wav",
    };
    const response = await fetchOk("/v1/audio/speech", { body });
    const blob = await response.blob();
    URL.revokeObjectURL(audio.src);
    audio.src = URL.createObjectURL(blob);
    audio.play().catch(() => {});  // autoplay may be refused; the controls still play it
    stats.textContent = `${(blob.size / 1024).toFixed(0)} KiB of wav in ${((performance.now() - started) / 1000).toFixed(1)} s`;
  } catch (error) {
    stats.textContent = `Refused: ${explain(error)}`;
  } finally {
    button.disabled = false;
  }
}
