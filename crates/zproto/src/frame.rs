//! Length-prefixed JSON frames, blocking (workers) and async (zrun).
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON. The
//! reader checks the length against the caller's maximum before allocating, so an
//! oversized or garbage prefix costs nothing but the connection.

use std::io::{Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Largest frame accepted from an authenticated peer.
pub const MAX_FRAME: usize = 64 << 20;
/// Largest frame accepted before authentication.
pub const HANDSHAKE_MAX: usize = 4 << 10;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The peer closed the connection at a frame boundary.
    #[error("connection closed")]
    Closed,
    /// Socket error (including timeouts).
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The length prefix exceeds the maximum.
    #[error("frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: usize,
        /// Allowed maximum.
        max: usize,
    },
    /// The bytes are not a valid message.
    #[error("undecodable frame: {0}")]
    Decode(String),
}

fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(msg).map_err(|e| FrameError::Decode(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge {
            len: body.len(),
            max: MAX_FRAME,
        });
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

fn decode<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    serde_json::from_slice(body).map_err(|e| FrameError::Decode(e.to_string()))
}

fn check_len(prefix: [u8; 4], max: usize) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > max {
        return Err(FrameError::TooLarge { len, max });
    }
    Ok(len)
}

fn eof_is_closed(e: std::io::Error) -> FrameError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        FrameError::Closed
    } else {
        FrameError::Io(e)
    }
}

/// Writes one frame (blocking).
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame of at most `max` bytes (blocking).
pub fn read_frame<R: Read, T: DeserializeOwned>(r: &mut R, max: usize) -> Result<T, FrameError> {
    let mut prefix = [0u8; 4];
    r.read_exact(&mut prefix).map_err(eof_is_closed)?;
    let len = check_len(prefix, max)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    decode(&body)
}

/// Writes one frame (async).
pub async fn write_frame_async<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), FrameError> {
    w.write_all(&encode(msg)?).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame of at most `max` bytes (async).
pub async fn read_frame_async<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
    max: usize,
) -> Result<T, FrameError> {
    let mut prefix = [0u8; 4];
    r.read_exact(&mut prefix).await.map_err(eof_is_closed)?;
    let len = check_len(prefix, max)?;
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    decode(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_rejects_oversized_or_garbage() {
        let mut buf = Vec::new();
        write_frame(&mut buf, &vec![1u32, 2, 3]).unwrap();
        let back: Vec<u32> = read_frame(&mut buf.as_slice(), 100).unwrap();
        assert_eq!(back, vec![1, 2, 3]);
        let e = read_frame::<_, Vec<u32>>(&mut buf.as_slice(), 3).unwrap_err();
        assert!(matches!(e, FrameError::TooLarge { len: 7, max: 3 }));
        let huge = [0xff, 0xff, 0xff, 0xff, 0];
        assert!(matches!(
            read_frame::<_, u32>(&mut &huge[..], MAX_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
        let garbage = [0, 0, 0, 2, b'{', b'x'];
        assert!(matches!(
            read_frame::<_, u32>(&mut &garbage[..], 10),
            Err(FrameError::Decode(_))
        ));
        assert!(matches!(
            read_frame::<_, u32>(&mut &[][..], 10),
            Err(FrameError::Closed)
        ));
    }
}
