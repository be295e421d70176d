//! Changing the registry: keys made, imported, updated, revoked and
//! rotated, one record at a time, each change made only from the record
//! it was computed from (a concurrent change makes it start again from the
//! new record), applied on this instance at once, and audited with who
//! made it and why.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::registry::{Digest, id_of};
use super::{Backing, Keys, Record, Source};
use crate::limit::StoreError;
use crate::limit::registry::{AuditEntry, Written};

/// Times a change is computed again after a concurrent one.
pub(super) const ATTEMPTS: usize = 5;

/// A new key's record, as an operator describes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Spec {
    /// The customer.
    pub identity: String,
    /// Its plan.
    pub plan: Option<String>,
    /// Its attributes.
    pub attributes: BTreeMap<String, String>,
    /// Enabled (the default) or not.
    pub enabled: Option<bool>,
    /// When it expires (ms since the epoch).
    pub expires_ms: Option<u64>,
    /// A label.
    pub name: Option<String>,
}

/// What an update changes; what it leaves out stays.
#[derive(Debug, Clone, Default)]
pub struct Patch {
    /// A new identity (the key moves to another customer).
    pub identity: Option<String>,
    /// A new plan (`Some(None)`: the default plan).
    pub plan: Option<Option<String>>,
    /// New attributes, replacing them all.
    pub attributes: Option<BTreeMap<String, String>>,
    /// Enabled or disabled.
    pub enabled: Option<bool>,
    /// A new expiry (`Some(None)`: never).
    pub expires_ms: Option<Option<u64>>,
    /// A new label (`Some(None)`: none).
    pub name: Option<Option<String>>,
}

/// A JSON field that may be absent (`None`: unchanged, with
/// `#[serde(default)]`), `null` (`Some(None)`: cleared) or a value.
pub fn maybe_null<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// A key given to import: as it is, or by its SHA-256.
#[derive(Debug, Clone)]
pub enum Given {
    /// The key itself.
    Key(String),
    /// Its SHA-256.
    Sha256([u8; 32]),
}

/// Who makes a change, and why.
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    /// The admin token's name, or `keys file`.
    pub operator: &'a str,
    /// Why.
    pub reason: &'a str,
}

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    /// No key has that id.
    #[error("no key is {0}")]
    NotFound(String),
    /// The key is already in the registry.
    #[error("that key is already in the registry as {0}")]
    Exists(String),
    /// It kept changing under this change.
    #[error("the key changed under this change {ATTEMPTS} times; try again")]
    Busy,
    /// The store could not make it.
    #[error("the store could not make the change: {0}")]
    Store(#[from] StoreError),
    /// The state file could not be written.
    #[error("the registry's state file could not be written: {0}")]
    File(String),
    /// What was asked is not a record.
    #[error("{0}")]
    Invalid(String),
    /// The key is the keys file's: only a change of the file changes it.
    #[error("{id} is listed in the keys file {file}, which owns it: edit the keys file and reload")]
    FileOwned {
        /// The key's id.
        id: String,
        /// The keys file.
        file: String,
    },
    /// The key to import is listed in the keys file.
    #[error("that key is listed in the keys file {0}: edit the keys file and reload")]
    Listed(String),
}

/// The keys file's last reconcile, as `/status.json` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Reconciled {
    /// The file.
    pub path: String,
    /// When (ms since the epoch).
    pub at_ms: u64,
    /// Keys it lists.
    pub keys: usize,
    /// Records it changed: added, updated, removed.
    pub changed: [usize; 3],
    /// Why it was refused or not finished, when it was.
    pub problem: Option<String>,
    /// Why it was not applied though nothing is wrong with the file (it
    /// lists no key without saying `key = []`).
    pub warning: Option<String>,
    /// Ids of keys it lists that the admin API made or imported: the
    /// file leaves them as they are.
    pub not_owned: Vec<String>,
}

/// A key floodgate made: the key (shown once) and its record.
#[derive(Debug, Clone)]
pub struct Made {
    /// The key, in the clear: never stored, never shown again.
    pub key: String,
    /// Its record.
    pub record: Arc<Record>,
}

impl Keys {
    /// Makes a key for `spec`: the configured prefix and 32 random
    /// characters (about 190 bits).
    pub async fn create(&self, spec: Spec, who: Who<'_>) -> Result<Made, ManageError> {
        let key = generate(&self.settings.prefix)?;
        let digest = self.replica.digest_of_key(key.as_bytes());
        let hint = key.get(..self.settings.prefix.len() + 4).map(str::to_owned);
        let record = self.new_record(&digest, spec, hint, Source::Api)?;
        let record = self.put_new(digest, record, "create", who).await?;
        Ok(Made { key, record })
    }

    /// Imports a key the customer already holds.
    pub async fn import(
        &self,
        given: &Given,
        spec: Spec,
        source: Source,
        who: Who<'_>,
    ) -> Result<Arc<Record>, ManageError> {
        let digest = self.digest_of(given);
        if source == Source::Api
            && let Some(file) = &self.settings.file
            && (self.listed_in_file(&digest)
                || self
                    .replica
                    .get(&digest)
                    .is_some_and(|r| r.source == Source::File))
        {
            return Err(ManageError::Listed(file.display().to_string()));
        }
        let record = self.new_record(&digest, spec, None, source)?;
        self.put_new(digest, record, "import", who).await
    }

    /// The digest a given key is kept under.
    pub fn digest_of(&self, given: &Given) -> Digest {
        match given {
            Given::Key(key) => self.replica.digest_of_key(key.as_bytes()),
            Given::Sha256(sha) => self.replica.digest_of_sha256(sha),
        }
    }

    /// The record of the key `id`.
    pub fn get(&self, id: &str) -> Option<Arc<Record>> {
        self.find_id(id).map(|(_, r)| r)
    }

    /// Every key of `identity`, oldest first.
    pub fn of_identity(&self, identity: &str) -> Vec<Arc<Record>> {
        let mut found: Vec<Arc<Record>> = self
            .replica
            .find(|r| r.identity == identity)
            .into_iter()
            .map(|(_, r)| r)
            .collect();
        found.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
        found
    }

    /// Changes the key `id` as `patch` says.
    pub async fn update(
        &self,
        id: &str,
        patch: &Patch,
        who: Who<'_>,
    ) -> Result<Arc<Record>, ManageError> {
        self.change(id, "update", who, |record| {
            self.refuse_file_owned(record)?;
            apply_patch(record, patch)?;
            Ok(Some(()))
        })
        .await?
        .ok_or_else(|| ManageError::NotFound(id.to_owned()))
    }

    /// Removes the key `id`: refused as unknown from now on.
    pub async fn revoke(&self, id: &str, who: Who<'_>) -> Result<Arc<Record>, ManageError> {
        let (digest, mut record) = self
            .find_id(id)
            .ok_or_else(|| ManageError::NotFound(id.to_owned()))?;
        for _ in 0..ATTEMPTS {
            self.refuse_file_owned(&record)?;
            match self
                .write(digest, None, Some(&record), "revoke", who)
                .await?
            {
                Written::Done { .. } => return Ok(record),
                Written::Refused { current: None } => {
                    return Err(ManageError::NotFound(id.to_owned()));
                }
                // It changed meanwhile (another instance, the keys file):
                // judged again as it is now.
                Written::Refused {
                    current: Some(text),
                } => record = Arc::new(read_stored(&text)?),
            }
        }
        Err(ManageError::Busy)
    }

    /// A new key for the key `id`'s identity, plan and attributes; the old
    /// one stays valid for `grace_ms` more (at most until it expired
    /// anyway). Returns the new key and the old key's record.
    pub async fn rotate(
        &self,
        id: &str,
        grace_ms: u64,
        who: Who<'_>,
    ) -> Result<(Made, Arc<Record>), ManageError> {
        let (_, old) = self
            .find_id(id)
            .ok_or_else(|| ManageError::NotFound(id.to_owned()))?;
        self.refuse_file_owned(&old)?;
        let spec = Spec {
            identity: old.identity.clone(),
            plan: old.plan.clone(),
            attributes: old
                .attributes
                .as_slice()
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            enabled: Some(old.enabled),
            expires_ms: old.expires_ms,
            name: old.name.clone(),
        };
        let made = self.create(spec, who).await?;
        let until = crate::clock::now_ms().saturating_add(grace_ms);
        let old = self
            .change(id, "rotate", who, |record| {
                self.refuse_file_owned(record)?;
                record.expires_ms = Some(record.expires_ms.map_or(until, |e| e.min(until)));
                Ok(Some(()))
            })
            .await?
            .ok_or_else(|| ManageError::NotFound(id.to_owned()))?;
        Ok((made, old))
    }

    /// Records an operator's action (a credit, a debit, a reset, a
    /// penalty lifted) in the audit.
    pub async fn audit_action(&self, entry: AuditEntry) -> Result<(), ManageError> {
        match &self.backing {
            Backing::Store(limiter) => Ok(limiter.audit_append(&entry).await?),
            Backing::File(file) => file
                .commit(&self.replica, Some(entry))
                .await
                .map_err(ManageError::File),
        }
    }

    /// The newest audit entries, at most `count`, of `identity` when given.
    pub async fn audit(
        &self,
        identity: Option<&str>,
        count: usize,
    ) -> Result<Vec<AuditEntry>, ManageError> {
        let keep = |e: &AuditEntry| identity.is_none_or(|i| e.identity == i);
        match &self.backing {
            Backing::Store(limiter) => Ok(limiter.audit_read(count, &keep).await?),
            Backing::File(file) => Ok(file.audit(count, &keep).await),
        }
    }

    /// Records the keys file's last reconcile.
    pub fn reconciled(&self, reconciled: Reconciled) {
        *self
            .reconciled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(reconciled);
    }

    /// Refuses a change through the API of a key the keys file owns (a
    /// record from the file while a file is configured: without one,
    /// nothing reconciles them and the API may change them).
    fn refuse_file_owned(&self, record: &Record) -> Result<(), ManageError> {
        match (&self.settings.file, record.source) {
            (Some(file), Source::File) => Err(ManageError::FileOwned {
                id: record.id.clone(),
                file: file.display().to_string(),
            }),
            _ => Ok(()),
        }
    }

    fn find_id(&self, id: &str) -> Option<(Digest, Arc<Record>)> {
        self.replica.find(|r| r.id == id).into_iter().next()
    }

    /// A record for the key `digest` as `spec` describes it, made now.
    pub(super) fn new_record(
        &self,
        digest: &Digest,
        spec: Spec,
        hint: Option<String>,
        source: Source,
    ) -> Result<Record, ManageError> {
        check_identity(&spec.identity)?;
        check_attributes(&spec.attributes)?;
        let now = crate::clock::now_ms();
        Ok(Record {
            id: id_of(digest),
            identity: spec.identity,
            plan: spec.plan,
            attributes: spec.attributes.into(),
            enabled: spec.enabled.unwrap_or(true),
            expires_ms: spec.expires_ms,
            name: spec.name,
            hint,
            source,
            created_ms: now,
            updated_ms: now,
        })
    }

    async fn put_new(
        &self,
        digest: Digest,
        record: Record,
        action: &str,
        who: Who<'_>,
    ) -> Result<Arc<Record>, ManageError> {
        let record = Arc::new(record);
        match self.write(digest, Some(&record), None, action, who).await? {
            Written::Done { .. } => Ok(record),
            Written::Refused { .. } => Err(ManageError::Exists(record.id.clone())),
        }
    }

    /// Changes the record of `id` with `edit` (which may decline with
    /// `None`), from the record as the store holds it: a concurrent change
    /// makes it start again. The record after, or `None` when declined.
    pub(super) async fn change(
        &self,
        id: &str,
        action: &str,
        who: Who<'_>,
        mut edit: impl FnMut(&mut Record) -> Result<Option<()>, ManageError>,
    ) -> Result<Option<Arc<Record>>, ManageError> {
        let (digest, mut current) = self
            .find_id(id)
            .ok_or_else(|| ManageError::NotFound(id.to_owned()))?;
        for _ in 0..ATTEMPTS {
            let mut next = (*current).clone();
            if edit(&mut next)?.is_none() {
                return Ok(None);
            }
            next.updated_ms = crate::clock::now_ms();
            let next = Arc::new(next);
            match self
                .write(digest, Some(&next), Some(&current), action, who)
                .await?
            {
                Written::Done { .. } => return Ok(Some(next)),
                Written::Refused { current: None } => {
                    return Err(ManageError::NotFound(id.to_owned()));
                }
                Written::Refused {
                    current: Some(text),
                } => {
                    current = Arc::new(read_stored(&text)?);
                }
            }
        }
        Err(ManageError::Busy)
    }
}

/// A record as the store holds it (JSON).
pub(super) fn read_stored(text: &str) -> Result<Record, ManageError> {
    serde_json::from_str(text)
        .map_err(|e| ManageError::Invalid(format!("the stored record cannot be read: {e}")))
}

fn apply_patch(record: &mut Record, patch: &Patch) -> Result<(), ManageError> {
    if let Some(identity) = &patch.identity {
        check_identity(identity)?;
        record.identity.clone_from(identity);
    }
    if let Some(plan) = &patch.plan {
        record.plan.clone_from(plan);
    }
    if let Some(attributes) = &patch.attributes {
        check_attributes(attributes)?;
        record.attributes = attributes.clone().into();
    }
    if let Some(enabled) = patch.enabled {
        record.enabled = enabled;
    }
    if let Some(expires) = patch.expires_ms {
        record.expires_ms = expires;
    }
    if let Some(name) = &patch.name {
        record.name.clone_from(name);
    }
    Ok(())
}

/// The longest identity, attribute name or value, in bytes.
const MAX_FIELD: usize = 256;

/// Most attributes on one key.
const MAX_ATTRIBUTES: usize = 32;

/// Refuses an identity that is empty or longer than 256 bytes.
pub fn check_identity(identity: &str) -> Result<(), ManageError> {
    if identity.is_empty() || identity.len() > MAX_FIELD {
        return Err(ManageError::Invalid(format!(
            "identity must be 1 to {MAX_FIELD} bytes"
        )));
    }
    Ok(())
}

/// Refuses more than 32 attributes, an empty name, or a name or value
/// longer than 256 bytes.
pub fn check_attributes(attributes: &BTreeMap<String, String>) -> Result<(), ManageError> {
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(ManageError::Invalid(format!(
            "a key has at most {MAX_ATTRIBUTES} attributes"
        )));
    }
    match attributes
        .iter()
        .find(|(k, v)| k.is_empty() || k.len() > MAX_FIELD || v.len() > MAX_FIELD)
    {
        Some((k, _)) => Err(ManageError::Invalid(format!(
            "attribute {k:?}: names are 1 to {MAX_FIELD} bytes, values at most {MAX_FIELD}"
        ))),
        None => Ok(()),
    }
}

/// Characters of a generated key.
const ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// Random characters of a generated key.
const KEY_CHARS: usize = 32;

/// A new key: `prefix` and 32 characters from the system's random source.
fn generate(prefix: &str) -> Result<String, ManageError> {
    use ring::rand::SecureRandom as _;
    let random = ring::rand::SystemRandom::new();
    let mut key = String::with_capacity(prefix.len() + KEY_CHARS);
    key.push_str(prefix);
    let mut bytes = [0u8; 64];
    while key.len() < prefix.len() + KEY_CHARS {
        random
            .fill(&mut bytes)
            .map_err(|_| ManageError::Invalid("no random bytes to make a key with".to_owned()))?;
        // 248 is 4 × 62: bytes past it would favour the first characters.
        for &b in bytes.iter().filter(|&&b| b < 248) {
            if key.len() == prefix.len() + KEY_CHARS {
                break;
            }
            key.push(char::from(ALPHABET[usize::from(b % 62)]));
        }
    }
    Ok(key)
}
