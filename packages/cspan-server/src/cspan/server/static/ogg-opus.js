// Ogg/Opus for the cspan serve page: WebCodecs (AudioEncoder / AudioDecoder) make and read raw Opus packets; this
// file wraps them in Ogg pages and takes them out again (RFC 3533 pages, RFC 7845 Opus mapping), which is what the
// server's sphn streams speak. Loaded before app.js; exposes window.OggOpus = { supported, Sender, Receiver }.
"use strict";

(() => {
  const RATE = 24000;
  const FRAME = 1920;
  const GRANULE_PER_PACKET_20MS = 960; // Opus granule positions count 48 kHz samples

  // CRC-32 of Ogg pages: polynomial 0x04C11DB7, not reflected, initial 0, checksum field taken as 0.
  const CRC = new Uint32Array(256);
  for (let i = 0; i < 256; i++) {
    let r = i << 24;
    for (let k = 0; k < 8; k++) r = r & 0x80000000 ? (r << 1) ^ 0x04c11db7 : r << 1;
    CRC[i] = r >>> 0;
  }
  function crc(page) {
    let c = 0;
    for (let i = 0; i < page.length; i++) c = ((c << 8) ^ CRC[((c >>> 24) ^ page[i]) & 0xff]) >>> 0;
    return c;
  }

  const ascii = (s) => new TextEncoder().encode(s);
  const startsWith = (bytes, s) => s.split("").every((ch, i) => bytes[i] === ch.charCodeAt(0));

  // One Ogg page holding `packets` (each under 255 * 255 bytes) that end on it.
  function page(packets, granule, serial, sequence, headerType) {
    const lacing = [];
    for (const p of packets) {
      let n = p.length;
      while (n >= 255) {
        lacing.push(255);
        n -= 255;
      }
      lacing.push(n);
    }
    const bodyLength = packets.reduce((a, p) => a + p.length, 0);
    const out = new Uint8Array(27 + lacing.length + bodyLength);
    const v = new DataView(out.buffer);
    out.set(ascii("OggS"), 0);
    out[4] = 0; // version
    out[5] = headerType;
    v.setUint32(6, granule % 2 ** 32, true);
    v.setUint32(10, Math.floor(granule / 2 ** 32), true);
    v.setUint32(14, serial, true);
    v.setUint32(18, sequence, true);
    out[26] = lacing.length;
    out.set(lacing, 27);
    let o = 27 + lacing.length;
    for (const p of packets) {
      out.set(p, o);
      o += p.length;
    }
    v.setUint32(22, crc(out), true);
    return out;
  }

  function opusHead(preSkip) {
    const h = new Uint8Array(19);
    const v = new DataView(h.buffer);
    h.set(ascii("OpusHead"), 0);
    h[8] = 1; // version
    h[9] = 1; // mono
    v.setUint16(10, preSkip, true);
    v.setUint32(12, RATE, true); // the input rate, informational
    return h;
  }

  function opusTags() {
    const vendor = ascii("cspan serve page (WebCodecs)");
    const t = new Uint8Array(8 + 4 + vendor.length + 4);
    const v = new DataView(t.buffer);
    t.set(ascii("OpusTags"), 0);
    v.setUint32(8, vendor.length, true);
    t.set(vendor, 12);
    v.setUint32(12 + vendor.length, 0, true); // no user comments
    return t;
  }

  // Microphone frames (Float32Array [1920] at 24 kHz) -> Ogg/Opus bytes, through `send(Uint8Array)`: the two header
  // pages first, then one page per 80 ms (four 20 ms packets).
  class Sender {
    constructor(send, onError) {
      this.send = send;
      this.serial = (Math.random() * 2 ** 32) >>> 0;
      this.sequence = 0;
      this.granule = 0;
      this.packets = [];
      this.frames = 0;
      this.headerSent = false;
      this.encoder = new AudioEncoder({ output: (chunk, meta) => this.onPacket(chunk, meta), error: onError });
      this.encoder.configure({
        codec: "opus",
        sampleRate: RATE,
        numberOfChannels: 1,
        bitrate: 32000,
        opus: { frameDuration: 20000 },
      });
    }

    encode(frame) {
      const data = new AudioData({
        format: "f32",
        sampleRate: RATE,
        numberOfFrames: FRAME,
        numberOfChannels: 1,
        timestamp: Math.round((this.frames++ * FRAME * 1e6) / RATE),
        data: frame,
      });
      this.encoder.encode(data);
      data.close();
    }

    onPacket(chunk, meta) {
      if (!this.headerSent) {
        let head = null;
        const desc = meta && meta.decoderConfig && meta.decoderConfig.description;
        if (desc && desc.byteLength >= 19) head = new Uint8Array(desc.buffer ? desc.buffer : desc).slice(0, 19);
        if (!head || !startsWith(head, "OpusHead")) head = opusHead(312);
        const preSkip = head[10] | (head[11] << 8);
        this.granule = preSkip;
        this.send(page([head], 0, this.serial, this.sequence++, 0x02));
        this.send(page([opusTags()], 0, this.serial, this.sequence++, 0x00));
        this.headerSent = true;
      }
      const packet = new Uint8Array(chunk.byteLength);
      chunk.copyTo(packet);
      this.packets.push(packet);
      this.granule += Math.round(((chunk.duration || 20000) * 48000) / 1e6) || GRANULE_PER_PACKET_20MS;
      if (this.packets.length >= 4) this.flush();
    }

    flush() {
      if (!this.packets.length) return;
      this.send(page(this.packets, this.granule, this.serial, this.sequence++, 0x00));
      this.packets = [];
    }

    close() {
      try {
        this.encoder.close();
      } catch (e) {
        /* already closed */
      }
    }
  }

  // Ogg/Opus bytes from the server -> PCM at 24 kHz, through `onPcm(Float32Array)`.
  class Receiver {
    constructor(onPcm, onError) {
      this.onPcm = onPcm;
      this.buf = new Uint8Array(0);
      this.partial = []; // pieces of a packet continued on the next page
      this.timestamp = 0;
      this.decoder = new AudioDecoder({ output: (a) => this.onAudio(a), error: onError });
      this.decoder.configure({ codec: "opus", sampleRate: RATE, numberOfChannels: 1 });
    }

    push(bytes) {
      const joined = new Uint8Array(this.buf.length + bytes.length);
      joined.set(this.buf, 0);
      joined.set(bytes, this.buf.length);
      let o = 0;
      while (joined.length - o >= 27) {
        if (!startsWith(joined.subarray(o, o + 4), "OggS")) {
          o++; // resynchronise on the next capture pattern
          continue;
        }
        const nseg = joined[o + 26];
        if (joined.length - o < 27 + nseg) break;
        const lacing = joined.subarray(o + 27, o + 27 + nseg);
        const size = 27 + nseg + lacing.reduce((a, b) => a + b, 0);
        if (joined.length - o < size) break;
        let p = o + 27 + nseg;
        for (const len of lacing) {
          this.partial.push(joined.subarray(p, p + len));
          p += len;
          if (len < 255) this.packet();
        }
        o += size;
      }
      this.buf = joined.slice(o);
    }

    packet() {
      const n = this.partial.reduce((a, b) => a + b.length, 0);
      const data = new Uint8Array(n);
      let o = 0;
      for (const piece of this.partial) {
        data.set(piece, o);
        o += piece.length;
      }
      this.partial = [];
      if (startsWith(data, "OpusHead") || startsWith(data, "OpusTags") || !data.length) return;
      this.decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: this.timestamp, data }));
      this.timestamp += 20000;
    }

    onAudio(a) {
      const n = a.numberOfFrames;
      const x = new Float32Array(n);
      a.copyTo(x, { planeIndex: 0, format: "f32-planar" });
      const rate = a.sampleRate;
      a.close();
      this.onPcm(rate === RATE ? x : resample(x, rate, RATE));
    }

    close() {
      try {
        this.decoder.close();
      } catch (e) {
        /* already closed */
      }
    }
  }

  function resample(x, from, to) {
    const n = Math.floor((x.length * to) / from);
    const y = new Float32Array(n);
    const step = from / to;
    for (let i = 0; i < n; i++) {
      const p = i * step;
      const k = Math.floor(p);
      const b = k + 1 < x.length ? x[k + 1] : x[k];
      y[i] = x[k] + (b - x[k]) * (p - k);
    }
    return y;
  }

  async function supported() {
    if (!window.AudioEncoder || !window.AudioDecoder || !window.EncodedAudioChunk || !window.AudioData) return false;
    try {
      const config = { codec: "opus", sampleRate: RATE, numberOfChannels: 1 };
      const [e, d] = await Promise.all([AudioEncoder.isConfigSupported(config), AudioDecoder.isConfigSupported(config)]);
      return Boolean(e.supported && d.supported);
    } catch (err) {
      return false;
    }
  }

  window.OggOpus = { supported, Sender, Receiver };
})();
