// The cspan serve page: microphone -> WebSocket -> agent audio, transcripts and Context Spans.
// Protocol: docs/PROTOCOL.md (binary = Ogg/Opus where the browser has WebCodecs, else one 80 ms frame of float32
// LE samples at 24 kHz, negotiated in start.codecs; text = JSON events). Ogg/Opus: ogg-opus.js.
// "Use my voice": 12 s recorded from the microphone, or a 2-30 s file (decoded by the browser), is sent as a 16-bit
// WAV at 24 kHz with voice_audio before start; the server answers voice (or error bad_voice_audio: the conversation
// then starts with the voice chosen before).
// URL parameters: ?token=... (sent as the WebSocket subprotocol cspan.token.<token>), ?aec=0 (no echo
// cancellation), ?raw=1 (no noise suppression or automatic gain), ?codec=pcm (no Opus), ?test={json} (test-only:
// sent as start.test, accepted only by a server started with test hooks).
// Every URL is relative to the page's own (here(): info, ws, static/...), never to the host's root: behind a reverse
// proxy that publishes the server under a path prefix (https://example.com/voice/ -> the server's /), the page, its
// scripts, /info and the WebSocket all stay under that prefix (docs/OPERATORS.md, "Under a path prefix").
"use strict";

(() => {
  const PROTOCOL_VERSION = 1;
  const RATE = 24000;
  const FRAME = 1920;
  const RECORD_SECONDS = 12;
  const MINE = "\u2063mine"; // the select's value for "my voice" (never a server voice name)
  const PIECE = 64 * 1024; // bytes per binary message of a voice recording
  // errors that answer start before ready: the conversation did not start (docs/PROTOCOL.md, "Error codes")
  const START_REFUSALS = new Set(["invalid_message", "bad_voice", "persona_failed", "unknown_type", "bad_json"]);
  const params = new URLSearchParams(location.search);
  const token = params.get("token");
  const $ = (id) => document.getElementById(id);
  // A URL of the server relative to this page (no query or fragment: ?token= stays out of every request URL).
  const here = (path) => new URL(path, location.href);
  // This page's own address with ?token=YOUR_TOKEN: under a proxy's prefix (/voice/) a bare /?token= would leave it.
  const withToken = () => {
    const u = here("");
    u.search = "?token=YOUR_TOKEN";
    return u.href;
  };

  const ui = {
    status: $("status"),
    dot: $("status-dot"),
    notice: $("notice"),
    insecure: $("notice-insecure"),
    prompt: $("text-prompt"),
    promptCount: $("prompt-count"),
    voice: $("voice"),
    recordVoice: $("record-voice"),
    voiceFile: $("voice-file"),
    voiceStatus: $("voice-status"),
    name: $("name"),
    location: $("location"),
    timezone: $("timezone"),
    lat: $("lat"),
    lon: $("lon"),
    locate: $("locate"),
    start: $("start"),
    stop: $("stop"),
    thread: $("thread"),
    spans: $("spans"),
    downloads: $("downloads"),
    wav: $("download-wav"),
    json: $("download-json"),
    levelUser: $("level-user"),
    levelAgent: $("level-agent"),
    transport: $("transport"),
  };

  let info = null;
  let s = null; // the running session (see newSession)
  let myVoice = null; // {wav: Uint8Array, seconds, source}: the user's own voice, in this page only
  let recording = false;
  let chosenVoice = ""; // the server voice chosen in the list ("" for none): what a refused recording falls back to

  // ------------------------------------------------------------------------------------------ page state

  function setStatus(text, kind) {
    ui.status.textContent = text;
    ui.dot.className = "dot " + (kind || text);
  }

  function notice(text, kind) {
    if (!text) {
      ui.notice.hidden = true;
      return;
    }
    ui.notice.textContent = text;
    ui.notice.className = "notice " + (kind || "");
    ui.notice.hidden = false;
  }

  function stored(key, fallback) {
    try {
      const v = localStorage.getItem(key);
      return v === null ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }

  function store(key, value) {
    try {
      if (value) localStorage.setItem(key, value);
      else localStorage.removeItem(key);
    } catch (e) {
      /* storage disabled: nothing to remember */
    }
  }

  function profile() {
    const num = (el) => {
      const v = parseFloat(el.value);
      return Number.isFinite(v) ? v : null;
    };
    const p = {}; // whose profile this is comes from the token, never from the page
    if (ui.name.value.trim()) p.name = ui.name.value.trim();
    if (ui.location.value.trim()) p.location = ui.location.value.trim();
    if (ui.timezone.value.trim()) p.timezone = ui.timezone.value.trim();
    const lat = num(ui.lat);
    const lon = num(ui.lon);
    if (lat !== null && lon !== null && Math.abs(lat) <= 90 && Math.abs(lon) <= 180) {
      p.lat = lat;
      p.lon = lon;
    }
    return p;
  }

  // The server limits the persona in Unicode code points (Python's len); a textarea's maxlength and String.length
  // count UTF-16 code units, two for an emoji or a rarer CJK character. So the page counts and cuts code points.
  let promptMax = 1000;
  let promptChars = 0; // code points before the latest edit: a persona over the limit may shrink, not grow

  function codePoints(text) {
    return [...text].length;
  }

  function updateCount() {
    promptChars = codePoints(ui.prompt.value);
    ui.promptCount.textContent = `(${promptChars}/${promptMax})`;
  }

  function clampPrompt(e) {
    if (e && e.isComposing) return; // an input method is composing: cut once it is done (compositionend)
    const el = ui.prompt;
    const excess = codePoints(el.value) - Math.max(promptMax, promptChars);
    if (excess > 0) {
      // what was typed or pasted ends at the caret: cut its end, as maxlength keeps what fits
      const head = [...el.value.slice(0, el.selectionEnd)];
      const kept = head.slice(0, Math.max(0, head.length - excess)).join("");
      el.value = kept + el.value.slice(el.selectionEnd);
      el.setSelectionRange(kept.length, kept.length);
    }
    updateCount();
  }

  async function loadInfo() {
    ui.timezone.value = stored("cspan.tz", "") || Intl.DateTimeFormat().resolvedOptions().timeZone || "";
    ui.name.value = stored("cspan.name", "");
    ui.location.value = stored("cspan.location", "");
    try {
      const r = await fetch(here("info"));
      info = await r.json();
    } catch (e) {
      notice("Cannot reach the server (" + e + ").", "bad");
      return;
    }
    promptMax = info.max_text_prompt_chars;
    ui.prompt.maxLength = 2 * promptMax; // a backstop only: no code point takes more than two UTF-16 units
    ui.prompt.value = stored("cspan.prompt", "") || info.text_prompt;
    const none = document.createElement("option");
    none.value = "";
    none.textContent = "(no voice prompt)";
    ui.voice.appendChild(none);
    for (const v of info.voices) {
      const o = document.createElement("option");
      o.value = v;
      o.textContent = v + (v === info.default_voice ? " (default)" : "");
      ui.voice.appendChild(o);
    }
    ui.voice.value = stored("cspan.voice", "") || info.default_voice || "";
    if (info.voice_recording) {
      const { min_seconds: min, max_seconds: max } = info.voice_recording;
      for (const label of ui.voiceFile.labels) label.title = `A recording of ${min} to ${max} s of your speech`;
    }
    if (![...ui.voice.options].some((o) => o.value === ui.voice.value)) ui.voice.value = info.default_voice || "";
    chosenVoice = ui.voice.value;
    updateCount();
    if (info.token_required && !token) {
      notice(`This server requires a token: open the page as ${withToken()}.`, "warn");
    } else if (info.token_required === null) {
      notice("The server cannot check credentials now (its database is away): try again in a moment.", "warn");
    }
    if (info.protocol_version !== PROTOCOL_VERSION) {
      notice(`Server protocol ${info.protocol_version}, page protocol ${PROTOCOL_VERSION}: reload the page.`, "warn");
    }
  }

  // ------------------------------------------------------------------------------------------ my voice

  function voiceStatus(text, bad) {
    ui.voiceStatus.textContent = text;
    ui.voiceStatus.className = "muted small" + (bad ? " bad" : "");
  }

  // mono float samples at 24 kHz -> 16-bit PCM WAV (x * 32768, clamped: a 16-bit file decoded by the browser
  // comes back with the very same samples)
  function wavMono(pcm) {
    const buf = new ArrayBuffer(44 + pcm.length * 2);
    const v = new DataView(buf);
    const w = (o, str) => {
      for (let i = 0; i < str.length; i++) v.setUint8(o + i, str.charCodeAt(i));
    };
    w(0, "RIFF");
    v.setUint32(4, 36 + pcm.length * 2, true);
    w(8, "WAVE");
    w(12, "fmt ");
    v.setUint32(16, 16, true);
    v.setUint16(20, 1, true);
    v.setUint16(22, 1, true);
    v.setUint32(24, RATE, true);
    v.setUint32(28, RATE * 2, true);
    v.setUint16(32, 2, true);
    v.setUint16(34, 16, true);
    w(36, "data");
    v.setUint32(40, pcm.length * 2, true);
    for (let i = 0; i < pcm.length; i++) {
      v.setInt16(44 + 2 * i, Math.max(-32768, Math.min(32767, Math.round(pcm[i] * 32768))), true);
    }
    return new Uint8Array(buf);
  }

  function limits() {
    const r = (info && info.voice_recording) || {};
    return { min: r.min_seconds || 2, max: r.max_seconds || 30, bytes: r.max_bytes || 8 * 1024 * 1024 };
  }

  // seconds: null when the browser could not decode the file (sent as it is)
  function setMyVoice(wav, seconds, source) {
    myVoice = { wav, seconds, source };
    const what = seconds === null ? source : `${source}, ${seconds.toFixed(1)} s`;
    let option = [...ui.voice.options].find((o) => o.value === MINE);
    if (!option) {
      option = document.createElement("option");
      option.value = MINE;
      ui.voice.appendChild(option);
    }
    option.textContent = `My voice (${what})`;
    if (ui.voice.value !== MINE) chosenVoice = ui.voice.value;
    ui.voice.value = MINE;
    voiceStatus(`Your voice is ready (${what}): it is sent with Start.`);
  }

  // the recording the server refused: out of the list, the server voice chosen before selected again
  function dropMyVoice() {
    myVoice = null;
    const option = [...ui.voice.options].find((o) => o.value === MINE);
    if (option) option.remove();
    ui.voice.value = chosenVoice;
  }

  // An audio worklet's module, from the server: one that does not load means the server is not answering (the
  // microphone was granted before), so the message says that instead of blaming the audio setup.
  async function addWorklet(ctx, url) {
    try {
      await ctx.audioWorklet.addModule(url);
    } catch (e) {
      throw Object.assign(new Error(`${url} could not be loaded from the server (${(e && e.message) || e})`), {
        unreachable: true,
      });
    }
  }

  // The microphone as 80 ms frames at RATE (the mic-frames worklet resamples), kept running through a muted output.
  async function micFrames(ctx, source) {
    await addWorklet(ctx, here("static/mic-worklet.js").href);
    const mic = new AudioWorkletNode(ctx, "mic-frames", {
      numberOfInputs: 1,
      numberOfOutputs: 1,
      outputChannelCount: [1],
      processorOptions: { frameSize: FRAME, inputRate: ctx.sampleRate, outputRate: RATE },
    });
    const mute = ctx.createGain();
    mute.gain.value = 0;
    source.connect(mic).connect(mute).connect(ctx.destination);
    return mic;
  }

  async function recordVoice() {
    if (recording) return;
    if (s && !s.finished) {
      voiceStatus("A voice is read when a conversation starts: record it after Stop, for the next one.", true);
      return;
    }
    if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
      ui.insecure.hidden = false;
      voiceStatus("The microphone is not available on this page.", true);
      return;
    }
    recording = true;
    ui.recordVoice.disabled = ui.start.disabled = true;
    let stream = null;
    let ctx = null;
    try {
      stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: false, noiseSuppression: false, autoGainControl: false },
      });
      try {
        ctx = new AudioContext({ sampleRate: RATE });
      } catch (e) {
        ctx = new AudioContext();
      }
      const mic = await micFrames(ctx, ctx.createMediaStreamSource(stream));
      const want = Math.round((RECORD_SECONDS * RATE) / FRAME);
      const frames = [];
      await ctx.resume();
      await new Promise((resolve) => {
        mic.port.onmessage = (e) => {
          if (frames.length >= want) return;
          frames.push(e.data);
          ui.levelUser.value = level(e.data);
          const left = Math.ceil(((want - frames.length) * FRAME) / RATE);
          voiceStatus(`Recording your voice: speak for ${left} more s…`);
          if (frames.length >= want) resolve();
        };
      });
      const pcm = new Float32Array(frames.length * FRAME);
      frames.forEach((f, i) => pcm.set(f, i * FRAME));
      setMyVoice(wavMono(pcm), pcm.length / RATE, "recorded");
    } catch (e) {
      voiceStatus("Recording failed: " + e, true);
    } finally {
      if (stream) stream.getTracks().forEach((t) => t.stop());
      if (ctx) ctx.close().catch(() => {});
      ui.levelUser.value = 0;
      recording = false;
      ui.recordVoice.disabled = false;
      ui.start.disabled = !!(s && !s.finished);
    }
  }

  async function uploadVoice(file) {
    if (!file) return;
    const { min, max, bytes } = limits();
    const data = new Uint8Array(await file.arrayBuffer());
    let pcm = null;
    try {
      // decoded and resampled to 24 kHz by the browser (any format it plays); channel 0, as the server takes it
      const decoded = await new OfflineAudioContext(1, 1, RATE).decodeAudioData(data.slice().buffer);
      pcm = decoded.getChannelData(0);
    } catch (e) {
      if (data.length > bytes) {
        voiceStatus(`${file.name}: this browser cannot read it, and it is too large to send as it is.`, true);
        return;
      }
      setMyVoice(data, null, file.name); // sent as it is: the server reads what libsndfile reads, or says why not
      voiceStatus(`${file.name}: this browser cannot read it; it is sent as it is and the server checks it.`);
      return;
    }
    const seconds = pcm.length / RATE;
    if (seconds < min || seconds > max) {
      voiceStatus(`${file.name} is ${seconds.toFixed(1)} s long; a voice needs ${min} to ${max} s of speech.`, true);
      return;
    }
    let peak = 0;
    for (let i = 0; i < pcm.length; i++) peak = Math.max(peak, Math.abs(pcm[i]));
    if (peak < 1e-4) {
      voiceStatus(`${file.name} is silent; record some speech.`, true);
      return;
    }
    setMyVoice(wavMono(pcm), seconds, file.name);
  }

  // ------------------------------------------------------------------------------------------ rendering

  function bubble(kind, who, text) {
    const b = document.createElement("div");
    b.className = "bubble " + kind;
    const w = document.createElement("span");
    w.className = "who";
    w.textContent = who;
    const t = document.createElement("span");
    t.className = "text";
    t.textContent = text || "";
    b.append(w, t);
    ui.thread.appendChild(b);
    ui.thread.scrollTop = ui.thread.scrollHeight;
    return b;
  }

  // SentencePiece byte-fallback pieces ("<0xE2>") arrive one per token: collect them and decode as UTF-8.
  const BYTE_PIECE = /^<0x([0-9A-Fa-f]{2})>$/;

  function pieceText(piece) {
    const m = BYTE_PIECE.exec(piece);
    if (m) {
      s.pendingBytes.push(parseInt(m[1], 16));
      return "";
    }
    let out = "";
    if (s.pendingBytes.length) {
      out = new TextDecoder("utf-8").decode(new Uint8Array(s.pendingBytes));
      s.pendingBytes = [];
    }
    return out + piece;
  }

  function onText(msg) {
    const text = pieceText(msg.text);
    if (!text) return;
    if (!s.agentBubble) {
      s.agentBubble = bubble("agent", "Agent", "");
      s.turns.push({ speaker: "agent", text: "", t: msg.t });
    }
    const t = s.agentBubble.querySelector(".text");
    t.textContent = (t.textContent + text).replace(/^\s+/, "");
    s.turns[s.turns.findLastIndex((x) => x.speaker === "agent")].text = t.textContent;
    s.agentText += text;
    ui.thread.scrollTop = ui.thread.scrollHeight;
  }

  function onUserText(msg) {
    let b = s.userBubbles.get(msg.utterance);
    if (!b) {
      b = bubble("user partial", "You", "");
      b.dataset.utterance = msg.utterance;
      s.userBubbles.set(msg.utterance, b);
    }
    b.querySelector(".text").textContent = msg.text || "…";
    if (msg.final) {
      b.classList.remove("partial");
      b.classList.add("final");
      if (msg.text) s.turns.push({ speaker: "user", text: msg.text, t: msg.start_s });
      s.agentBubble = null; // the next agent words start a new bubble
    }
  }

  function spanItem(className, html) {
    const li = document.createElement("li");
    li.className = className;
    li.append(...html);
    ui.spans.appendChild(li);
    return li;
  }

  function txt(text, cls) {
    const el = document.createElement("span");
    if (cls) el.className = cls;
    el.textContent = text;
    return el;
  }

  function onSpan(msg) {
    const source = msg.tool || msg.source || "given";
    spanItem("span", [txt(source, "tool"), txt(` ${msg.t.toFixed(2)} s: `), txt(msg.text)]);
    bubble("span", `Context Span (${source}, ${msg.n_frames} frames, ${msg.prefill_ms.toFixed(1)} ms)`, msg.text);
    s.agentBubble = null;
    setStatus("listening");
  }

  function onServerMessage(msg) {
    s.events.push(Object.assign({ t_page: (performance.now() - s.t0) / 1000 }, msg));
    switch (msg.type) {
      case "ready":
        s.ready = msg;
        s.readyAt = performance.now();
        startCodec(s, msg.codec || "pcm");
        setStatus("listening");
        if (!s.voiceRefused) notice(""); // a refused recording stays said: the conversation runs without it
        break;
      case "voice":
        voiceStatus(`The server took your voice (${msg.seconds.toFixed(1)} s, ${msg.frames} frames).`);
        if (s.pendingStart) sendStart(s, null);
        break;
      case "busy":
        s.busy = true;
        setStatus("busy");
        notice(msg.message, "bad");
        break;
      case "text":
        onText(msg);
        break;
      case "user_text":
        onUserText(msg);
        break;
      case "ret":
        if (!msg.ignored) setStatus("retrieving");
        break;
      case "question":
        spanItem("question", [txt("question", "tool"), txt(` ${msg.text}`)]);
        break;
      case "span":
        onSpan(msg);
        break;
      case "late":
        spanItem("late", [txt(`late (${msg.seconds.toFixed(1)} s), dropped: ${msg.text || msg.question || ""}${msg.error ? " (" + msg.error + ")" : ""}`)]);
        setStatus("listening");
        break;
      case "no_span":
        spanItem("none", [txt(`nothing to add${msg.error ? " (" + msg.error + ")" : ""}`)]);
        setStatus("listening");
        break;
      case "error":
        if (msg.code === "backend") {
          spanItem("none", [txt(`${msg.stage} failed: ${msg.message}`)]);
        } else if (msg.code === "bad_voice_audio" && s.pendingStart) {
          const fallback = s.fallbackVoice || "no voice prompt";
          dropMyVoice(); // not sent again with every Start
          voiceStatus(`The server did not take your voice: ${msg.message}`, true);
          notice(`Your recording was not used (${msg.message}); the conversation starts with ${fallback}.`, "warn");
          s.voiceRefused = true;
          sendStart(s, s.fallbackVoice);
        } else if (!s.ready && !s.stopping && START_REFUSALS.has(msg.code)) {
          // start was refused (a profile field, the persona, a voice): say why and end, Start can be pressed again
          s.refused = true;
          notice(`The server did not start the conversation: ${msg.message}`, "bad");
          setStatus("error");
          if (s.ws && s.ws.readyState === WebSocket.OPEN) s.ws.close(1000, "refused");
          finish(s);
        } else if (msg.code === "audio_overflow") {
          notice("The server is behind real time: some of your audio was dropped.", "warn behind");
        } else {
          notice(`Server: ${msg.message} (${msg.code})`, "warn");
        }
        break;
      case "bye":
        s.bye = msg;
        break;
      default:
        break; // slot and future messages are recorded only
    }
  }

  function level(frame) {
    let sum = 0;
    for (let i = 0; i < frame.length; i++) sum += frame[i] * frame[i];
    return Math.min(1, Math.sqrt(sum / frame.length) * 4);
  }

  // ------------------------------------------------------------------------------------------ session

  function newSession() {
    return {
      ws: null,
      ctx: null,
      stream: null,
      mic: null,
      player: null,
      ready: null,
      bye: null,
      busy: false,
      stopping: false,
      finished: false,
      t0: performance.now(),
      startedAt: new Date(),
      micFrames: [],
      agentFrames: [],
      events: [],
      pageEvents: [],
      turns: [],
      agentText: "",
      pendingBytes: [],
      agentBubble: null,
      userBubbles: new Map(),
      byeWaiter: null,
      opus: false, // the browser can encode and decode Opus (WebCodecs)
      codec: "pcm", // what the server chose (ready.codec)
      sender: null, // OggOpus.Sender
      receiver: null, // OggOpus.Receiver
      agentPcm: new Float32Array(0), // decoded agent samples not yet a whole frame
      bytesSent: 0,
      bytesReceived: 0,
      transportTimer: null,
      pendingStart: false, // start waits for the server's answer to the voice recording
      fallbackVoice: "", // the server voice used when the recording is refused
      voiceRefused: false, // the server refused the recording: the conversation started with the voice before
      refused: false, // the server refused start (or the connection could not be opened): the notice says why
    };
  }

  // The conversation's WebSocket next to the page: https://example.com/voice/ -> wss://example.com/voice/ws.
  function wsUrl() {
    const url = here("ws");
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    return url.href;
  }

  async function start() {
    if (!window.isSecureContext || !navigator.mediaDevices || !window.AudioWorkletNode) {
      ui.insecure.hidden = false;
      notice("The microphone is not available on this page (see above).", "bad");
      return;
    }
    ui.start.disabled = true;
    ui.downloads.hidden = true;
    ui.thread.textContent = "";
    ui.spans.textContent = "";
    notice("");
    s = newSession();
    const session = s;
    setStatus("connecting");
    for (const [k, el] of [
      ["cspan.name", ui.name],
      ["cspan.location", ui.location],
    ]) {
      store(k, el.value.trim());
    }
    if (ui.voice.value !== MINE) store("cspan.voice", ui.voice.value);
    store("cspan.prompt", info && ui.prompt.value === info.text_prompt ? "" : ui.prompt.value);
    try {
      session.stream = await navigator.mediaDevices.getUserMedia({
        audio: {
          channelCount: 1,
          echoCancellation: params.get("aec") !== "0",
          noiseSuppression: params.get("raw") !== "1",
          autoGainControl: params.get("raw") !== "1",
        },
      });
      try {
        session.ctx = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
      } catch (e) {
        session.ctx = new AudioContext({ latencyHint: "interactive" }); // resampled in the worklets
      }
      const ctx = session.ctx;
      await addWorklet(ctx, here("static/player-worklet.js").href);
      session.mic = await micFrames(ctx, ctx.createMediaStreamSource(session.stream));
      session.player = new AudioWorkletNode(ctx, "agent-player", {
        numberOfInputs: 0,
        numberOfOutputs: 1,
        outputChannelCount: [1],
        processorOptions: { inputRate: RATE, targetMs: 120 },
      });
      session.player.connect(ctx.destination);
      session.player.port.onmessage = (e) => {
        if (e.data.type !== "stats" || e.data.underruns) {
          session.pageEvents.push(Object.assign({ t_page: (performance.now() - session.t0) / 1000 }, e.data));
        }
      };
      session.mic.port.onmessage = (e) => onMicFrame(session, e.data);
      await ctx.resume();
      session.opus = params.get("codec") !== "pcm" && window.OggOpus && (await window.OggOpus.supported());
    } catch (e) {
      if (e && e.unreachable) notice(`Cannot reach the server: ${e.message}. Is cspan serve still running?`, "bad");
      else notice("Microphone or audio setup failed: " + e, "bad");
      await teardown(session);
      setStatus("error");
      ui.start.disabled = false;
      return;
    }
    connect(session);
  }

  function connect(session) {
    let ws;
    try {
      ws = token ? new WebSocket(wsUrl(), ["cspan.token." + token]) : new WebSocket(wsUrl());
    } catch (e) {
      // a ?token= with characters a WebSocket subprotocol cannot carry (a space, a comma, ...)
      const why = token ? "check the ?token= in the address (letters, digits and . _ ~ - only)" : String(e);
      notice(`Cannot connect to the server: ${why}.`, "bad");
      session.refused = true;
      setStatus("error");
      finish(session);
      return;
    }
    ws.binaryType = "arraybuffer";
    session.ws = ws;
    ws.onopen = () => {
      ui.stop.disabled = false;
      if (ui.voice.value === MINE && myVoice) {
        sendVoice(session, myVoice.wav);
        return;
      }
      sendStart(session, ui.voice.value === MINE ? chosenVoice : ui.voice.value);
    };
    ws.onmessage = (e) => {
      if (typeof e.data === "string") {
        let msg;
        try {
          msg = JSON.parse(e.data);
        } catch (err) {
          return;
        }
        onServerMessage(msg);
        if (msg.type === "bye" && session.byeWaiter) session.byeWaiter();
        return;
      }
      session.bytesReceived += e.data.byteLength;
      if (session.receiver) {
        session.receiver.push(new Uint8Array(e.data));
        return;
      }
      const frame = new Float32Array(e.data);
      if (frame.length !== FRAME) return;
      onAgentFrame(session, frame);
    };
    ws.onclose = (e) => {
      if (session.byeWaiter) session.byeWaiter();
      if (session.refused) {
        /* the notice already says why the server refused the start */
      } else if (session.bye && session.bye.reason === "revoked") notice("The session ended: this token was revoked.", "bad");
      else if (session.bye && session.bye.reason === "forgotten") notice("The session ended: everything remembered about you was erased. Start again for a fresh session.", "bad");
      else if (e.code === 4401) {
        /* a missing or wrong token: how to give one; any other reason (a token without the session scope): the server's */
        const why = (e.reason || "").replace(/^unauthorized:?\s*/, "");
        if (!why || why === "missing token" || why === "wrong token") notice(`The server refused the token: open the page as ${withToken()}.`, "bad");
        else notice(`The server refused the token: ${why}.`, "bad");
      }
      else if (e.code === 4403) notice("The server refused this page's origin (see --allow-origin).", "bad");
      else if (session.busy) {
        /* the busy notice already gives the server's reason (all slots taken, or this user's limit) */
      } else if (e.code === 1013) notice(e.reason ? `The server cannot take this now: ${e.reason}; try again later.` : "All conversation slots are busy; try again later.", "bad");
      else if (session.bye && session.bye.reason === "idle") notice("The session ended: no audio for a while.", "warn");
      else if (session.bye && session.bye.reason === "shutdown") notice("The session ended: the server is shutting down; Start again in a moment.", "warn");
      else if (session.bye && session.bye.reason !== "stop" && !session.stopping) {
        // slow_client, error, and reasons this page does not know yet: never end without a word
        notice(`The session ended (${session.bye.reason}${session.bye.message ? ": " + session.bye.message : ""}).`, "bad");
      }
      else if (!session.stopping && !session.bye) notice(`Connection closed (code ${e.code}).`, "bad");
      finish(session);
    };
  }

  // voice: a server voice name, "" for none, null for the recording sent before
  function sendStart(session, voice) {
    session.pendingStart = false;
    const msg = {
      type: "start",
      version: PROTOCOL_VERSION,
      profile: profile(),
      codecs: session.opus ? ["opus", "pcm"] : ["pcm"],
    };
    if (voice !== null) msg.voice = voice;
    // the server's own persona is left out (null: its default), which may be longer than a client may send
    if (!info || ui.prompt.value !== info.text_prompt) msg.text_prompt = ui.prompt.value;
    if (params.get("test")) {
      try {
        msg.test = JSON.parse(params.get("test"));
      } catch (e) {
        notice("?test= is not JSON: " + e, "warn");
      }
    }
    session.ws.send(JSON.stringify(msg));
  }

  // the recording as voice_audio and its bytes in pieces; start follows the server's answer (onServerMessage)
  function sendVoice(session, bytes) {
    // pieces within the server's message limit (--max-message-kib: a larger one is refused, the upload never ends)
    const piece = Math.min(PIECE, (info && info.max_message_bytes) || PIECE);
    session.pendingStart = true;
    session.fallbackVoice = chosenVoice;
    voiceStatus("Sending your voice…");
    session.ws.send(JSON.stringify({ type: "voice_audio", size: bytes.length }));
    for (let o = 0; o < bytes.length; o += piece) session.ws.send(bytes.subarray(o, o + piece));
  }

  function onAgentFrame(session, frame) {
    session.agentFrames.push(frame.slice());
    ui.levelAgent.value = level(frame);
    session.player.port.postMessage(frame, [frame.buffer]);
  }

  // Decoded Opus arrives in 20 ms pieces: cut it into the 80 ms frames the player and the recording use.
  function onAgentPcm(session, pcm) {
    const joined = new Float32Array(session.agentPcm.length + pcm.length);
    joined.set(session.agentPcm, 0);
    joined.set(pcm, session.agentPcm.length);
    let o = 0;
    for (; o + FRAME <= joined.length; o += FRAME) onAgentFrame(session, joined.slice(o, o + FRAME));
    session.agentPcm = joined.slice(o);
  }

  function startCodec(session, codec) {
    session.codec = codec;
    if (codec === "opus") {
      const failed = (e) => {
        session.pageEvents.push({ t_page: (performance.now() - session.t0) / 1000, type: "codec_error", error: String(e) });
        notice("Opus failed in this browser (" + e + "); reload with ?codec=pcm.", "bad");
      };
      session.sender = new window.OggOpus.Sender((bytes) => {
        const ws = session.ws;
        if (ws && ws.readyState === WebSocket.OPEN) {
          ws.send(bytes);
          session.bytesSent += bytes.length;
        }
      }, failed);
      session.receiver = new window.OggOpus.Receiver((pcm) => onAgentPcm(session, pcm), failed);
    }
    session.transportTimer = setInterval(() => showTransport(session), 1000);
  }

  function transport(session) {
    const seconds = session.readyAt ? (performance.now() - session.readyAt) / 1000 : 0;
    // per second of audio carried (machine independent), and per second of wall clock
    const sentAudio = (session.micFrames.length * FRAME) / RATE;
    const receivedAudio = (session.agentFrames.length * FRAME) / RATE;
    const rate = (bytes, s) => (s > 0 ? Math.round(bytes / s) : null);
    return {
      codec: session.codec,
      seconds: Math.round(seconds * 1000) / 1000,
      bytes_sent: session.bytesSent,
      bytes_received: session.bytesReceived,
      audio_seconds_sent: sentAudio,
      audio_seconds_received: receivedAudio,
      sent_bytes_per_audio_s: rate(session.bytesSent, sentAudio),
      received_bytes_per_audio_s: rate(session.bytesReceived, receivedAudio),
      sent_bytes_per_s: rate(session.bytesSent, seconds),
      received_bytes_per_s: rate(session.bytesReceived, seconds),
    };
  }

  function showTransport(session) {
    const t = transport(session);
    const kbit = (b) => (b === null ? "–" : ((b * 8) / 1000).toFixed(0));
    ui.transport.textContent = `${t.codec} ↑${kbit(t.sent_bytes_per_s)} ↓${kbit(t.received_bytes_per_s)} kbit/s`;
    ui.transport.dataset.codec = t.codec;
  }

  function onMicFrame(session, frame) {
    ui.levelUser.value = level(frame);
    const ws = session.ws;
    if (!session.ready || session.stopping || !ws || ws.readyState !== WebSocket.OPEN) return;
    session.micFrames.push(frame);
    if (session.sender) {
      session.sender.encode(frame);
      return;
    }
    ws.send(frame.buffer);
    session.bytesSent += frame.byteLength;
  }

  function sendContext() {
    if (s && s.ready && !s.stopping && s.ws && s.ws.readyState === WebSocket.OPEN) {
      s.ws.send(JSON.stringify({ type: "context", profile: profile() }));
    }
  }

  async function stop() {
    const session = s;
    if (!session || session.stopping) return;
    session.stopping = true;
    ui.stop.disabled = true;
    if (ui.notice.classList.contains("behind")) notice(""); // nothing is sent any more: no longer behind
    setStatus("stopping", "connecting");
    const ws = session.ws;
    if (session.sender) {
      try {
        await session.sender.encoder.flush(); // the last microphone audio goes out before stop
      } catch (e) {
        /* the encoder failed or closed: nothing left to send */
      }
      session.sender.flush();
    }
    if (ws && ws.readyState === WebSocket.OPEN) {
      const got = new Promise((resolve) => {
        session.byeWaiter = resolve;
      });
      ws.send(JSON.stringify({ type: "stop" }));
      session.pageEvents.push({ t_page: (performance.now() - session.t0) / 1000, type: "stop_sent" });
      // the server plays the queued audio through and waits briefly for the last transcripts before its bye
      const timedOut = await Promise.race([got.then(() => false), new Promise((r) => setTimeout(r, 20000, true))]);
      if (timedOut) session.pageEvents.push({ t_page: (performance.now() - session.t0) / 1000, type: "no_bye" });
      if (ws.readyState === WebSocket.OPEN) ws.close(1000, "stop");
    }
    finish(session);
  }

  async function teardown(session) {
    if (session.transportTimer) clearInterval(session.transportTimer);
    if (session.ready) showTransport(session);
    for (const codec of [session.sender, session.receiver]) if (codec) codec.close();
    if (session.stream) session.stream.getTracks().forEach((t) => t.stop());
    if (session.ctx && session.ctx.state !== "closed") {
      try {
        await session.ctx.close();
      } catch (e) {
        /* already closed */
      }
    }
  }

  async function finish(session) {
    if (session.finished) return;
    session.finished = true;
    session.stopping = true;
    if (ui.notice.classList.contains("behind")) notice(""); // about the live session only
    await teardown(session);
    ui.stop.disabled = true;
    ui.start.disabled = false;
    if (!session.busy && !session.refused) setStatus("idle");
    if (session.micFrames.length || session.agentFrames.length) offerDownloads(session);
  }

  // ------------------------------------------------------------------------------------------ downloads

  function wavStereo(left, right) {
    const n = Math.max(left.length, right.length) * FRAME;
    const buf = new ArrayBuffer(44 + n * 4);
    const v = new DataView(buf);
    const w = (o, str) => {
      for (let i = 0; i < str.length; i++) v.setUint8(o + i, str.charCodeAt(i));
    };
    w(0, "RIFF");
    v.setUint32(4, 36 + n * 4, true);
    w(8, "WAVE");
    w(12, "fmt ");
    v.setUint32(16, 16, true);
    v.setUint16(20, 1, true); // PCM
    v.setUint16(22, 2, true); // stereo
    v.setUint32(24, RATE, true);
    v.setUint32(28, RATE * 4, true);
    v.setUint16(32, 4, true);
    v.setUint16(34, 16, true);
    w(36, "data");
    v.setUint32(40, n * 4, true);
    const pcm = (frames, i) => {
      const f = frames[Math.floor(i / FRAME)];
      const x = f ? f[i % FRAME] : 0;
      return Math.max(-32768, Math.min(32767, Math.round(x * 32767)));
    };
    let o = 44;
    for (let i = 0; i < n; i++) {
      v.setInt16(o, pcm(left, i), true);
      v.setInt16(o + 2, pcm(right, i), true);
      o += 4;
    }
    return new Blob([buf], { type: "audio/wav" });
  }

  function offerDownloads(session) {
    const stamp = session.startedAt.toISOString().replace(/[:.]/g, "-").replace("Z", "");
    const frames = Math.max(session.micFrames.length, session.agentFrames.length);
    const transcript = {
      recorded_at: session.startedAt.toISOString(),
      protocol_version: PROTOCOL_VERSION,
      sample_rate: RATE,
      seconds: (frames * FRAME) / RATE,
      channels: { left: "user (microphone as sent)", right: "agent (as received)" },
      session_id: session.ready ? session.ready.session_id : null,
      conversation_id: session.ready ? session.ready.conversation_id : null,
      persona: session.ready ? session.ready.persona : null,
      profile: session.ready ? session.ready.profile : profile(),
      stats: session.bye ? session.bye.stats : null,
      transport: transport(session),
      agent_text: session.agentText.trim(),
      turns: session.turns.filter((t) => t.text),
      events: session.events,
      page_events: session.pageEvents,
    };
    for (const a of [ui.wav, ui.json]) if (a.href) URL.revokeObjectURL(a.href);
    ui.wav.href = URL.createObjectURL(wavStereo(session.micFrames, session.agentFrames));
    ui.wav.download = `contextspanning-${stamp}.wav`;
    ui.json.href = URL.createObjectURL(
      new Blob([JSON.stringify(transcript, null, 2)], { type: "application/json" }),
    );
    ui.json.download = `contextspanning-${stamp}.json`;
    ui.downloads.hidden = false;
  }

  // ------------------------------------------------------------------------------------------ wiring

  ui.start.addEventListener("click", start);
  ui.recordVoice.addEventListener("click", recordVoice);
  for (const label of ui.voiceFile.labels) {
    // the file input is hidden: its label is the button, reachable from the keyboard too
    label.addEventListener("keydown", (e) => {
      if (e.key !== "Enter" && e.key !== " ") return;
      e.preventDefault();
      ui.voiceFile.click();
    });
  }
  ui.voiceFile.addEventListener("change", () => {
    uploadVoice(ui.voiceFile.files[0]).catch((e) => voiceStatus("The file could not be read: " + e, true));
    ui.voiceFile.value = ""; // the same file chosen again is read again
  });
  ui.stop.addEventListener("click", stop);
  ui.voice.addEventListener("change", () => {
    if (ui.voice.value !== MINE) chosenVoice = ui.voice.value;
  });
  ui.prompt.addEventListener("input", clampPrompt);
  ui.prompt.addEventListener("compositionend", () => clampPrompt());
  for (const el of [ui.name, ui.location, ui.timezone, ui.lat, ui.lon]) el.addEventListener("change", sendContext);
  ui.timezone.addEventListener("change", () => {
    // kept for the next visit only when this browser knows the zone (the server refuses one it does not know, and a
    // stored one would make every later Start fail)
    const tz = ui.timezone.value.trim();
    try {
      if (tz) new Intl.DateTimeFormat("en", { timeZone: tz });
      store("cspan.tz", tz);
    } catch (e) {
      /* not a zone: not stored */
    }
  });
  ui.locate.addEventListener("click", () => {
    if (!navigator.geolocation) {
      notice("Geolocation is not available in this browser.", "warn");
      return;
    }
    navigator.geolocation.getCurrentPosition(
      (pos) => {
        ui.lat.value = pos.coords.latitude.toFixed(4);
        ui.lon.value = pos.coords.longitude.toFixed(4);
        sendContext();
      },
      (err) => notice("Location unavailable: " + err.message, "warn"),
      { timeout: 10000, maximumAge: 600000 },
    );
  });
  if (!window.isSecureContext) ui.insecure.hidden = false;
  loadInfo();
})();
