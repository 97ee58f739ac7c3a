//! The job token and the proofs derived from it.
//!
//! A proof is `HMAC-SHA256(token, context || nonce || rank)`. The verifier picks the
//! nonce fresh for every connection, so a recorded proof is useless later, and the
//! token itself never crosses the wire. The `context` string separates the control
//! plane from the data plane so a proof from one cannot be replayed on the other.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// A random per-connection challenge.
pub type Nonce = [u8; 32];

/// An HMAC tag, hex-encoded on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proof(pub String);

/// The secret shared by zrun and the workers of one job.
#[derive(Clone)]
pub struct Token(Vec<u8>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// A fresh random token.
    pub fn generate() -> Token {
        Token(random_bytes::<32>().to_vec())
    }

    /// Parses the hex form (as found in `ZRUN_TOKEN`).
    pub fn from_hex(s: &str) -> Option<Token> {
        let b = from_hex(s.trim())?;
        (b.len() >= 16).then_some(Token(b))
    }

    /// The hex form, for the worker environment.
    pub fn to_hex(&self) -> String {
        to_hex(&self.0)
    }

    /// The proof that `rank` knows the token, for `nonce` in `context`.
    pub fn prove(&self, context: &str, nonce: &Nonce, rank: u64) -> Proof {
        Proof(to_hex(
            &self.mac(context, nonce, rank).finalize().into_bytes(),
        ))
    }

    /// Checks a proof in constant time.
    pub fn verify(&self, context: &str, nonce: &Nonce, rank: u64, proof: &Proof) -> bool {
        match from_hex(&proof.0) {
            Some(tag) => self.mac(context, nonce, rank).verify_slice(&tag).is_ok(),
            None => false,
        }
    }

    fn mac(&self, context: &str, nonce: &Nonce, rank: u64) -> HmacSha256 {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(context.as_bytes());
        m.update(&[0]);
        m.update(nonce);
        m.update(&rank.to_be_bytes());
        m
    }
}

/// A fresh random nonce.
pub fn nonce() -> Nonce {
    random_bytes::<32>()
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).expect("the operating system's random source failed");
    b
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_token_nonce_rank_and_context() {
        let t = Token::generate();
        let n = nonce();
        let p = t.prove("control", &n, 3);
        assert!(t.verify("control", &n, 3, &p));
        assert!(!t.verify("control", &n, 2, &p));
        assert!(!t.verify("data", &n, 3, &p));
        assert!(!t.verify("control", &nonce(), 3, &p));
        assert!(!Token::generate().verify("control", &n, 3, &p));
        assert!(!t.verify("control", &n, 3, &Proof("zz".into())));
        let back = Token::from_hex(&t.to_hex()).unwrap();
        assert!(back.verify("control", &n, 3, &p));
        assert!(Token::from_hex("abc").is_none());
        // Shorter than 16 bytes is too weak to accept.
        assert!(Token::from_hex(&"ab".repeat(15)).is_none());
        assert!(Token::from_hex(&"ab".repeat(16)).is_some());
    }

    /// A token never reaches a log through `{:?}` (errors and traces print the
    /// structs that hold one).
    #[test]
    fn debug_output_redacts_the_token() {
        let t = Token::generate();
        let shown = format!("{t:?} {:?}", Some(&t));
        assert!(!shown.contains(&t.to_hex()[..8]), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }
}
