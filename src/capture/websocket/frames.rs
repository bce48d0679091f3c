//! RFC 6455 framing, read from one direction's relayed bytes: frames are unmasked, fragments joined into
//! messages, control frames skipped, and permessage-deflate (RFC 7692) messages inflated, with or without
//! context takeover. Works on whatever chunks the relay read (a frame header may be split anywhere) and never
//! holds more than `cap` bytes of one message: the rest of a longer message is still read past (and, when
//! compressed, still inflated so that the shared window stays right) but not kept, and the message is marked.

use flate2::{Decompress, FlushDecompress, Status};

use super::super::UnixMicros;

/// One whole message as the application sent it (inflated), or its first `cap` bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub text: bool,
    pub data: Vec<u8>,
    /// Bytes beyond `cap` were not kept (or could not be inflated).
    pub truncated: bool,
    /// The message's length (inflated), including what was not kept.
    pub len: u64,
    /// When the relay read the message's last bytes.
    pub at: UnixMicros,
}

/// Why a direction's framing could no longer be followed (capture of that direction stops; traffic is not
/// affected: the relay copies bytes whatever they are).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FrameError {
    #[error("reserved opcode {0:#x}")]
    Opcode(u8),
    #[error("a control frame is fragmented or longer than 125 bytes")]
    Control,
    #[error("a continuation frame without a message to continue")]
    Continuation,
    #[error("a new message began before the previous one ended")]
    Interleaved,
    #[error("a compressed frame (RSV1) without permessage-deflate negotiated")]
    Compressed,
}

/// The permessage-deflate parameters that apply to one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Deflate {
    /// The sender resets its compressor after each message (`client_no_context_takeover` for the client's
    /// direction, `server_no_context_takeover` for the server's).
    pub no_context_takeover: bool,
}

/// What the 101 response's `sec-websocket-extensions` agreed, per direction: (client→server, server→client).
pub fn negotiated_deflate(extensions: Option<&str>) -> (Option<Deflate>, Option<Deflate>) {
    let Some(ext) = extensions else {
        return (None, None);
    };
    for offer in ext.split(',') {
        let mut params = offer.split(';').map(str::trim);
        if !params
            .next()
            .is_some_and(|n| n.eq_ignore_ascii_case("permessage-deflate"))
        {
            continue;
        }
        let (mut client, mut server) = (Deflate::default(), Deflate::default());
        for p in params {
            let name = p.split('=').next().unwrap_or("").trim();
            if name.eq_ignore_ascii_case("client_no_context_takeover") {
                client.no_context_takeover = true;
            } else if name.eq_ignore_ascii_case("server_no_context_takeover") {
                server.no_context_takeover = true;
            }
        }
        return (Some(client), Some(server));
    }
    (None, None)
}

enum State {
    /// Reading a frame header; `header[..have]` read so far.
    Header,
    Payload {
        remaining: u64,
        mask: Option<[u8; 4]>,
        /// Bytes of this frame's payload already read (the mask's phase).
        done: u64,
        control: bool,
        fin: bool,
    },
}

struct Partial {
    text: bool,
    compressed: bool,
    data: Vec<u8>,
    truncated: bool,
    len: u64,
}

pub struct FrameReader {
    cap: usize,
    header: [u8; 14],
    have: usize,
    state: State,
    message: Option<Partial>,
    deflate: Option<Deflate>,
    inflater: Option<Decompress>,
    /// Unmasking happens here, reused across frames.
    scratch: Vec<u8>,
    broken: Option<FrameError>,
}

/// What a deflate block ends with once the sender's trailing `00 00 ff ff` was removed (RFC 7692 §7.2.2).
const DEFLATE_TAIL: [u8; 4] = [0x00, 0x00, 0xff, 0xff];

impl FrameReader {
    pub fn new(cap: usize, deflate: Option<Deflate>) -> FrameReader {
        FrameReader {
            cap,
            header: [0; 14],
            have: 0,
            state: State::Header,
            message: None,
            deflate,
            inflater: deflate.map(|_| Decompress::new(false)),
            scratch: Vec::new(),
            broken: None,
        }
    }

    /// The framing error that stopped this direction, if any.
    pub fn broken(&self) -> Option<&FrameError> {
        self.broken.as_ref()
    }

    /// A message begun but not ended (the socket closed mid-message): its kept prefix, marked truncated.
    pub fn unfinished(&mut self, at: UnixMicros) -> Option<Message> {
        self.message.take().map(|p| Message {
            text: p.text,
            data: p.data,
            truncated: true,
            len: p.len,
            at,
        })
    }

    /// Read `data`, the next bytes of this direction; whole messages are pushed to `out`.
    pub fn feed(&mut self, mut data: &[u8], at: UnixMicros, out: &mut Vec<Message>) {
        while !data.is_empty() && self.broken.is_none() {
            match self.state {
                State::Header => {
                    let need = self.header_len();
                    let take = (need - self.have).min(data.len());
                    self.header[self.have..self.have + take].copy_from_slice(&data[..take]);
                    self.have += take;
                    data = &data[take..];
                    // The length may need more bytes than first thought (a 2-byte header announces the rest).
                    if self.have == self.header_len()
                        && let Err(e) = self.start_frame(at, out)
                    {
                        self.broken = Some(e);
                    }
                }
                State::Payload { remaining, .. } => {
                    let take = (remaining.min(data.len() as u64)) as usize;
                    self.payload(&data[..take]);
                    data = &data[take..];
                    if let State::Payload { remaining, .. } = &mut self.state {
                        *remaining -= take as u64;
                    }
                    self.end_frame_if_done(at, out);
                }
            }
        }
    }

    /// Bytes the current header needs, as far as its first two bytes tell.
    fn header_len(&self) -> usize {
        if self.have < 2 {
            return 2;
        }
        let masked = self.header[1] & 0x80 != 0;
        let ext = match self.header[1] & 0x7f {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        2 + ext + if masked { 4 } else { 0 }
    }

    fn start_frame(&mut self, at: UnixMicros, out: &mut Vec<Message>) -> Result<(), FrameError> {
        let (b0, b1) = (self.header[0], self.header[1]);
        let fin = b0 & 0x80 != 0;
        let rsv1 = b0 & 0x40 != 0;
        let opcode = b0 & 0x0f;
        let mut at_byte = 2;
        let len = match b1 & 0x7f {
            126 => {
                at_byte += 2;
                u64::from(u16::from_be_bytes([self.header[2], self.header[3]]))
            }
            127 => {
                at_byte += 8;
                let mut b = [0u8; 8];
                b.copy_from_slice(&self.header[2..10]);
                u64::from_be_bytes(b)
            }
            n => u64::from(n),
        };
        let mask = (b1 & 0x80 != 0).then(|| {
            let mut m = [0u8; 4];
            m.copy_from_slice(&self.header[at_byte..at_byte + 4]);
            m
        });
        let control = opcode & 0x08 != 0;
        match opcode {
            0x0 => {
                if self.message.is_none() {
                    return Err(FrameError::Continuation);
                }
            }
            0x1 | 0x2 => {
                if self.message.is_some() {
                    return Err(FrameError::Interleaved);
                }
                if rsv1 && self.deflate.is_none() {
                    return Err(FrameError::Compressed);
                }
                self.message = Some(Partial {
                    text: opcode == 0x1,
                    compressed: rsv1,
                    data: Vec::new(),
                    truncated: false,
                    len: 0,
                });
            }
            0x8..=0xa => {
                if !fin || len > 125 {
                    return Err(FrameError::Control);
                }
            }
            other => return Err(FrameError::Opcode(other)),
        }
        self.have = 0;
        self.state = State::Payload {
            remaining: len,
            mask,
            done: 0,
            control,
            fin,
        };
        self.end_frame_if_done(at, out);
        Ok(())
    }

    fn payload(&mut self, bytes: &[u8]) {
        let State::Payload {
            mask, done, control, ..
        } = &mut self.state
        else {
            return;
        };
        let phase = *done;
        *done += bytes.len() as u64;
        if *control {
            return;
        }
        let bytes: &[u8] = match mask {
            Some(m) => {
                self.scratch.clear();
                self.scratch.extend(
                    bytes
                        .iter()
                        .enumerate()
                        .map(|(i, b)| b ^ m[((phase + i as u64) % 4) as usize]),
                );
                &self.scratch
            }
            None => bytes,
        };
        let Some(message) = self.message.as_mut() else {
            return;
        };
        if message.compressed {
            match self.inflater.as_mut() {
                Some(inflater) => inflate(inflater, bytes, FlushDecompress::None, message, self.cap),
                None => message.truncated = true,
            }
        } else {
            keep(message, bytes, self.cap);
        }
    }

    fn end_frame_if_done(&mut self, at: UnixMicros, out: &mut Vec<Message>) {
        let State::Payload {
            remaining: 0,
            control,
            fin,
            ..
        } = self.state
        else {
            return;
        };
        self.state = State::Header;
        if control || !fin {
            return;
        }
        let Some(mut message) = self.message.take() else {
            return;
        };
        if message.compressed
            && let Some(inflater) = self.inflater.as_mut()
        {
            inflate(inflater, &DEFLATE_TAIL, FlushDecompress::Sync, &mut message, self.cap);
            if self.deflate.is_some_and(|d| d.no_context_takeover) {
                inflater.reset(false);
            }
        }
        out.push(Message {
            text: message.text,
            data: message.data,
            truncated: message.truncated,
            len: message.len,
            at,
        });
    }
}

fn keep(message: &mut Partial, bytes: &[u8], cap: usize) {
    message.len += bytes.len() as u64;
    let room = cap.saturating_sub(message.data.len());
    if bytes.len() > room {
        message.truncated = true;
    }
    message.data.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// Inflate `input` into the message (up to `cap`; output past it is produced, to keep the window, and dropped).
fn inflate(inflater: &mut Decompress, mut input: &[u8], flush: FlushDecompress, message: &mut Partial, cap: usize) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let (before_in, before_out) = (inflater.total_in(), inflater.total_out());
        let status = inflater.decompress(input, &mut buf, flush);
        let used = (inflater.total_in() - before_in) as usize;
        let made = (inflater.total_out() - before_out) as usize;
        input = &input[used..];
        keep(message, &buf[..made], cap);
        match status {
            Err(_) => {
                message.truncated = true;
                return;
            }
            Ok(Status::StreamEnd) => return,
            Ok(_) if (made < buf.len() && input.is_empty()) || (used == 0 && made == 0) => return,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(fin: bool, rsv1: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut f = vec![(u8::from(fin) << 7) | (u8::from(rsv1) << 6) | opcode];
        let m = if mask.is_some() { 0x80 } else { 0 };
        match payload.len() {
            n if n < 126 => f.push(m | n as u8),
            n if n < 65536 => {
                f.push(m | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(m | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        match mask {
            Some(k) => {
                f.extend_from_slice(&k);
                f.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
            }
            None => f.extend_from_slice(payload),
        }
        f
    }

    /// Feeds `bytes` one byte at a time: every split point of headers and payloads is exercised.
    fn read_bytewise(reader: &mut FrameReader, bytes: &[u8]) -> Vec<Message> {
        let mut out = Vec::new();
        for b in bytes {
            reader.feed(std::slice::from_ref(b), 7, &mut out);
        }
        out
    }

    #[test]
    fn masked_fragmented_messages_with_control_frames_between_are_joined() {
        let mut wire = frame(false, false, 0x1, b"hel", Some([1, 2, 3, 4]));
        wire.extend(frame(true, false, 0x9, b"ping", Some([9, 9, 9, 9])));
        wire.extend(frame(true, false, 0x0, b"lo", Some([5, 6, 7, 8])));
        wire.extend(frame(true, false, 0x2, &[0u8; 70_000], None));
        let mut r = FrameReader::new(1 << 20, None);
        let out = read_bytewise(&mut r, &wire);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].data, b"hello");
        assert!(out[0].text && !out[0].truncated);
        assert_eq!(out[1].data.len(), 70_000);
        assert!(!out[1].text);
        assert!(r.broken().is_none());
    }

    #[test]
    fn a_message_over_the_cap_is_cut_and_marked_and_the_next_one_is_read_whole() {
        let mut wire = frame(true, false, 0x1, &vec![b'a'; 10 << 20], None);
        wire.extend(frame(true, false, 0x1, b"next", None));
        let mut r = FrameReader::new(1024, None);
        let mut out = Vec::new();
        for chunk in wire.chunks(64 * 1024) {
            r.feed(chunk, 1, &mut out);
        }
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].data.len(), 1024);
        assert!(out[0].truncated);
        assert_eq!(out[1].data, b"next");
        assert!(!out[1].truncated);
    }

    fn deflate_stream() -> flate2::Compress {
        flate2::Compress::new(flate2::Compression::default(), false)
    }

    /// One message compressed as RFC 7692 says: a sync flush, its trailing `00 00 ff ff` removed.
    fn compress(c: &mut flate2::Compress, text: &[u8], reset: bool) -> Vec<u8> {
        if reset {
            c.reset();
        }
        let mut out = Vec::with_capacity(text.len() + 64);
        c.compress_vec(text, &mut out, flate2::FlushCompress::Sync).unwrap();
        assert!(out.ends_with(&DEFLATE_TAIL));
        out.truncate(out.len() - 4);
        out
    }

    #[test]
    fn permessage_deflate_with_context_takeover_inflates_every_message() {
        let mut c = deflate_stream();
        let text = br#"{"type":"response.output_text.delta","delta":"hello hello hello"}"#;
        let (first, second) = (compress(&mut c, text, false), compress(&mut c, text, false));
        assert!(
            second.len() < first.len(),
            "the second message refers back to the first"
        );
        // The second message is fragmented: RSV1 on its first frame only.
        let mut wire = frame(true, true, 0x1, &first, None);
        let (a, b) = second.split_at(second.len() / 2);
        wire.extend(frame(false, true, 0x1, a, None));
        wire.extend(frame(true, false, 0x0, b, None));
        wire.extend(frame(true, false, 0x1, b"plain", None));
        let (_, server) = negotiated_deflate(Some("permessage-deflate; client_max_window_bits=15"));
        let mut r = FrameReader::new(1 << 20, server);
        let out = read_bytewise(&mut r, &wire);
        let texts: Vec<&[u8]> = out.iter().map(|m| m.data.as_slice()).collect();
        assert_eq!(texts, [&text[..], &text[..], b"plain"]);
    }

    #[test]
    fn permessage_deflate_without_context_takeover_resets_between_messages() {
        let mut c = deflate_stream();
        let text = b"the same text twice, compressed on its own each time";
        let wire: Vec<u8> = [compress(&mut c, text, true), compress(&mut c, text, true)]
            .iter()
            .flat_map(|p| frame(true, true, 0x1, p, Some([7, 7, 7, 7])))
            .collect();
        let (client, _) = negotiated_deflate(Some("permessage-deflate; client_no_context_takeover"));
        assert_eq!(
            client,
            Some(Deflate {
                no_context_takeover: true
            })
        );
        let mut r = FrameReader::new(1 << 20, client);
        let out = read_bytewise(&mut r, &wire);
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|m| m.data == text && !m.truncated));
    }

    #[test]
    fn a_socket_closed_mid_message_leaves_a_marked_prefix_and_garbage_stops_the_reader() {
        let wire = frame(true, false, 0x1, b"0123456789", None);
        let mut r = FrameReader::new(1 << 20, None);
        let mut out = Vec::new();
        r.feed(&wire[..7], 1, &mut out);
        assert!(out.is_empty());
        let cut = r.unfinished(2).unwrap();
        assert_eq!(cut.data, b"01234");
        assert!(cut.truncated);

        let mut r = FrameReader::new(1 << 20, None);
        r.feed(&[0x83, 0x00, 0x81, 0x00], 1, &mut out);
        assert_eq!(r.broken(), Some(&FrameError::Opcode(3)));
        assert!(out.is_empty());
    }
}
