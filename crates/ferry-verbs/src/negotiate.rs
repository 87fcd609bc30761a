//! Protocol versions and optional features of the control channel, and the
//! rule that decides what a pair of engines speaks (see `PROTOCOL.md`).
//!
//! Each side announces a [`VersionRange`] and a set of [`Feature`]s; the
//! pair speaks the highest version both ranges contain and uses the
//! features both announced ([`choose`]: a pure function of the two offers,
//! so both sides compute the same answer). A peer of protocol 3 (builds up
//! to 7c3e5e6) announces nothing: it is taken to speak exactly 3, with every
//! feature protocol 3 has ([`Offer::legacy`]). The only refusal is
//! [`NoCommonVersion`], naming both ranges and which side to upgrade.
#![cfg_attr(not(feature = "rdma"), allow(dead_code))]

use std::fmt;

/// The oldest control-channel protocol this build speaks: 3, the
/// authentication exchange first and notifications SENT on the queue pair
/// (builds 57c35fa … 7c3e5e6, which announce no range).
pub(crate) const OLDEST: u16 = 3;
/// The newest: 4, protocol 3 with the negotiated hello (`Offer` /
/// `Agreed` frames carrying version ranges and feature extensions).
pub(crate) const NEWEST: u16 = 4;
/// The first version whose hello announces a range (`Offer`).
pub(crate) const FIRST_NEGOTIATED: u16 = 4;

/// An inclusive range of control-channel protocol versions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VersionRange {
    /// Oldest version spoken.
    pub min: u16,
    /// Newest version spoken (`>= min`).
    pub max: u16,
}

impl VersionRange {
    /// `min..=max`; `None` if `min > max`.
    pub fn new(min: u16, max: u16) -> Option<VersionRange> {
        (min <= max).then_some(VersionRange { min, max })
    }

    /// Whether `v` is in the range.
    pub fn contains(&self, v: u16) -> bool {
        self.min <= v && v <= self.max
    }
}

impl fmt::Display for VersionRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}–{}", self.min, self.max)
        }
    }
}

/// An optional part of the control-channel protocol, negotiated as an
/// extension of the hello. Protocol 3 has all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Feature {
    /// Notifications SENT on the queue pair after the batch's data and
    /// answered on the control channel (extension 1). Without it a batch
    /// with a notification to that peer is refused before anything moves
    /// (`Error::Unsupported`).
    Notify,
    /// The owner pushes `RegionAdded` / `RegionRemoved` as it registers and
    /// unregisters (extension 2). Without it the opener learns of new
    /// regions only by fetching the table on a miss.
    RegionPush,
    /// The opener fetches the owner's table on a miss (`TableRequest`,
    /// extension 3). Without it a miss fails `AddressNotRegistered` at once.
    TableFetch,
}

impl Feature {
    /// Every feature this build knows, in extension-id order.
    pub const ALL: [Feature; 3] = [Feature::Notify, Feature::RegionPush, Feature::TableFetch];

    /// The extension id on the wire.
    pub(crate) fn id(self) -> u16 {
        match self {
            Feature::Notify => 1,
            Feature::RegionPush => 2,
            Feature::TableFetch => 3,
        }
    }

    pub(crate) fn from_id(id: u16) -> Option<Feature> {
        Feature::ALL.into_iter().find(|f| f.id() == id)
    }

    /// The name used in URLs and reports (`notify`, `region_push`,
    /// `table_fetch`).
    pub fn name(self) -> &'static str {
        match self {
            Feature::Notify => "notify",
            Feature::RegionPush => "region_push",
            Feature::TableFetch => "table_fetch",
        }
    }

    /// The feature called `name` (see [`Feature::name`]).
    pub fn from_name(name: &str) -> Option<Feature> {
        Feature::ALL.into_iter().find(|f| f.name() == name)
    }

    fn bit(self) -> u8 {
        1 << (self.id() - 1)
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Feature`]s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct FeatureSet(u8);

impl FeatureSet {
    /// Every feature this build has (and protocol 3 has).
    pub(crate) fn all() -> FeatureSet {
        Feature::ALL.into_iter().collect()
    }

    pub(crate) fn contains(self, f: Feature) -> bool {
        self.0 & f.bit() != 0
    }

    pub(crate) fn insert(&mut self, f: Feature) {
        self.0 |= f.bit();
    }

    pub(crate) fn remove(&mut self, f: Feature) {
        self.0 &= !f.bit();
    }

    pub(crate) fn intersection(self, other: FeatureSet) -> FeatureSet {
        FeatureSet(self.0 & other.0)
    }

    #[cfg(test)]
    pub(crate) fn is_subset(self, other: FeatureSet) -> bool {
        self.0 & !other.0 == 0
    }

    pub(crate) fn iter(self) -> impl Iterator<Item = Feature> {
        Feature::ALL.into_iter().filter(move |f| self.contains(*f))
    }
}

impl FromIterator<Feature> for FeatureSet {
    fn from_iter<I: IntoIterator<Item = Feature>>(iter: I) -> FeatureSet {
        let mut s = FeatureSet::default();
        for f in iter {
            s.insert(f);
        }
        s
    }
}

/// What one side announces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Offer {
    pub versions: VersionRange,
    pub features: FeatureSet,
    /// Extension ids this build does not know, as received (ignored; kept
    /// for the report).
    pub unknown: Vec<u16>,
}

impl Offer {
    /// What a peer of protocol 3 speaks: exactly 3, every feature.
    pub(crate) fn legacy() -> Offer {
        Offer {
            versions: VersionRange {
                min: OLDEST,
                max: OLDEST,
            },
            features: FeatureSet::all(),
            unknown: Vec::new(),
        }
    }

    /// This build's offer: [`OLDEST`]..=[`NEWEST`] capped at `max` (a
    /// test-only setting), every feature but `off`.
    pub(crate) fn local(max: Option<u16>, off: &[Feature]) -> Offer {
        let top = max.map_or(NEWEST, |m| m.clamp(OLDEST, NEWEST));
        let mut features = FeatureSet::all();
        for f in off {
            features.remove(*f);
        }
        Offer {
            versions: VersionRange {
                min: OLDEST,
                max: top,
            },
            features,
            unknown: Vec::new(),
        }
    }

    /// Whether this side sends (and answers) the negotiated hello: its
    /// range reaches [`FIRST_NEGOTIATED`]. A side capped at 3 behaves
    /// exactly as a protocol-3 build.
    pub(crate) fn negotiates(&self) -> bool {
        self.versions.max >= FIRST_NEGOTIATED
    }
}

/// The outcome for one pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Agreement {
    pub version: u16,
    pub features: FeatureSet,
    pub local: Offer,
    pub peer: Offer,
    /// `false` when the peer announced nothing (a protocol-3 hello).
    pub negotiated: bool,
}

/// The refusal: the two ranges do not meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NoCommonVersion {
    pub opener: VersionRange,
    pub owner: VersionRange,
}

impl fmt::Display for NoCommonVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (older, newer) = if self.opener.max < self.owner.min {
            ("opener", self.owner)
        } else {
            ("owner", self.opener)
        };
        write!(
            f,
            "no common verbs control-channel protocol version: the opener speaks {}, the owner \
             speaks {}; upgrade the {older} to a build that speaks {} or later",
            self.opener, self.owner, newer.min
        )
    }
}

/// The version and features a pair uses: the highest version in both
/// ranges and the features both offer. Symmetric in its arguments apart
/// from which is `local`.
pub(crate) fn choose(
    local: &Offer,
    peer: &Offer,
    local_is_opener: bool,
) -> Result<Agreement, NoCommonVersion> {
    let top = local.versions.max.min(peer.versions.max);
    let bottom = local.versions.min.max(peer.versions.min);
    if top < bottom {
        let (opener, owner) = if local_is_opener {
            (local.versions, peer.versions)
        } else {
            (peer.versions, local.versions)
        };
        return Err(NoCommonVersion { opener, owner });
    }
    Ok(Agreement {
        version: top,
        features: local.features.intersection(peer.features),
        local: local.clone(),
        peer: peer.clone(),
        negotiated: true,
    })
}

/// How one feature came out for a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FeatureState {
    /// Both sides announced it.
    On,
    /// On: the peer speaks protocol 3, which has it without announcing it.
    OnImplied,
    /// Off: this engine does not offer it (a setting disabled it).
    OffHere,
    /// Off: the peer did not announce it.
    OffPeer,
}

impl FeatureState {
    /// Whether the feature is in use with that peer.
    pub fn is_on(self) -> bool {
        matches!(self, FeatureState::On | FeatureState::OnImplied)
    }
}

impl fmt::Display for FeatureState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FeatureState::On => "on",
            FeatureState::OnImplied => "on (implied by protocol 3)",
            FeatureState::OffHere => "off (disabled on this engine)",
            FeatureState::OffPeer => "off (the peer lacks it)",
        })
    }
}

/// What this engine and one peer speak on their control channel, as
/// negotiated when the connection was made.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PeerProtocol {
    /// The peer: a segment name (opened by this engine) or the address of
    /// an opener (connected to this engine).
    pub peer: String,
    /// Whether this engine opened the connection.
    pub opened_here: bool,
    /// The versions this engine announced.
    pub local: VersionRange,
    /// The versions the peer announced (`3` for a protocol-3 peer, which
    /// announces none).
    pub remote: VersionRange,
    /// The version in use.
    pub version: u16,
    /// `false`: the peer announced nothing (a build of protocol 3).
    pub negotiated: bool,
    /// Every feature this build knows, and whether it is in use.
    pub features: Vec<(Feature, FeatureState)>,
    /// Extension ids the peer announced that this build does not know
    /// (ignored).
    pub unknown_extensions: Vec<u16>,
}

impl PeerProtocol {
    pub(crate) fn new(peer: &str, opened_here: bool, a: &Agreement) -> PeerProtocol {
        let features = Feature::ALL
            .into_iter()
            .map(|f| {
                let state = if !a.local.features.contains(f) {
                    FeatureState::OffHere
                } else if !a.peer.features.contains(f) {
                    FeatureState::OffPeer
                } else if a.negotiated {
                    FeatureState::On
                } else {
                    FeatureState::OnImplied
                };
                (f, state)
            })
            .collect();
        PeerProtocol {
            peer: peer.to_owned(),
            opened_here,
            local: a.local.versions,
            remote: a.peer.versions,
            version: a.version,
            negotiated: a.negotiated,
            features,
            unknown_extensions: a.peer.unknown.clone(),
        }
    }

    /// Whether `f` is in use with this peer.
    pub fn has(&self, f: Feature) -> bool {
        self.features.iter().any(|(g, s)| *g == f && s.is_on())
    }
}

impl fmt::Display for PeerProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "protocol {} (this engine {}, the peer {}{})",
            self.version,
            self.local,
            self.remote,
            if self.negotiated {
                ""
            } else {
                ": a build without negotiation"
            }
        )?;
        for (feat, state) in &self.features {
            write!(f, "; {feat} {state}")?;
        }
        if !self.unknown_extensions.is_empty() {
            write!(f, "; ignored extensions {:?}", self.unknown_extensions)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn offer(min: u16, max: u16, features: &[Feature]) -> Offer {
        Offer {
            versions: VersionRange::new(min, max).unwrap(),
            features: features.iter().copied().collect(),
            unknown: Vec::new(),
        }
    }

    #[test]
    fn overlapping_ranges_use_the_highest_common_version() {
        let all = &Feature::ALL;
        let a = offer(3, 4, all);
        assert_eq!(choose(&a, &offer(3, 4, all), true).unwrap().version, 4);
        assert_eq!(choose(&a, &Offer::legacy(), true).unwrap().version, 3);
        assert_eq!(choose(&a, &offer(4, 9, all), false).unwrap().version, 4);
        assert_eq!(
            choose(&offer(3, 7, all), &offer(5, 9, all), true)
                .unwrap()
                .version,
            7
        );
        assert_eq!(choose(&a, &offer(1, 3, all), true).unwrap().version, 3);
    }

    #[test]
    fn disjoint_ranges_name_both_and_the_side_to_upgrade() {
        let all = &Feature::ALL;
        // The opener is older.
        let e = choose(&offer(3, 4, all), &offer(5, 6, all), true).unwrap_err();
        assert_eq!(e.opener, VersionRange { min: 3, max: 4 });
        assert_eq!(e.owner, VersionRange { min: 5, max: 6 });
        let text = e.to_string();
        assert!(text.contains("the opener speaks 3–4"), "{text}");
        assert!(text.contains("the owner speaks 5–6"), "{text}");
        assert!(
            text.contains("upgrade the opener to a build that speaks 5"),
            "{text}"
        );
        // The same pair seen from the owner.
        let e2 = choose(&offer(5, 6, all), &offer(3, 4, all), false).unwrap_err();
        assert_eq!(e, e2);
        // The owner is older (a protocol-3 peer).
        let e = choose(&offer(5, 6, all), &Offer::legacy(), true).unwrap_err();
        assert!(
            e.to_string()
                .contains("upgrade the owner to a build that speaks 5"),
            "{e}"
        );
    }

    #[test]
    fn features_are_intersected_and_reported_with_the_reason() {
        let local = offer(3, 4, &[Feature::Notify, Feature::TableFetch]);
        let peer = offer(3, 4, &[Feature::Notify, Feature::RegionPush]);
        let a = choose(&local, &peer, true).unwrap();
        assert_eq!(a.features, [Feature::Notify].into_iter().collect());
        let r = PeerProtocol::new("p", true, &a);
        assert_eq!(
            r.features,
            vec![
                (Feature::Notify, FeatureState::On),
                (Feature::RegionPush, FeatureState::OffHere),
                (Feature::TableFetch, FeatureState::OffPeer),
            ]
        );
        assert!(r.has(Feature::Notify) && !r.has(Feature::TableFetch));
        let legacy = Agreement {
            negotiated: false,
            ..choose(&Offer::local(None, &[]), &Offer::legacy(), true).unwrap()
        };
        let r = PeerProtocol::new("p", true, &legacy);
        assert!(r
            .features
            .iter()
            .all(|(_, s)| *s == FeatureState::OnImplied));
        assert!(r.to_string().contains("a build without negotiation"), "{r}");
    }

    #[test]
    fn the_local_offer_and_its_test_cap() {
        let o = Offer::local(None, &[]);
        assert_eq!(o.versions, VersionRange { min: 3, max: 4 });
        assert!(o.negotiates());
        assert_eq!(o.features, FeatureSet::all());
        let capped = Offer::local(Some(3), &[Feature::RegionPush]);
        assert_eq!(capped.versions, VersionRange { min: 3, max: 3 });
        assert!(!capped.negotiates());
        assert!(!capped.features.contains(Feature::RegionPush));
        assert!(capped.features.contains(Feature::Notify));
        for f in Feature::ALL {
            assert_eq!(Feature::from_id(f.id()), Some(f));
            assert_eq!(Feature::from_name(f.name()), Some(f));
        }
        assert_eq!(Feature::from_id(0), None);
        assert_eq!(Feature::from_id(99), None);
    }

    fn range() -> impl Strategy<Value = VersionRange> {
        (0u16..12, 0u16..6).prop_map(|(min, span)| VersionRange {
            min,
            max: min + span,
        })
    }

    fn features() -> impl Strategy<Value = FeatureSet> {
        (0u8..8).prop_map(FeatureSet)
    }

    proptest! {
        /// Both sides compute the same answer, the version is the highest in
        /// both ranges, and a refusal happens exactly when they are disjoint.
        #[test]
        fn choose_is_symmetric_and_picks_the_highest_common(
            a in range(), b in range(), fa in features(), fb in features()
        ) {
            let oa = Offer { versions: a, features: fa, unknown: vec![] };
            let ob = Offer { versions: b, features: fb, unknown: vec![] };
            let ab = choose(&oa, &ob, true);
            let ba = choose(&ob, &oa, false);
            let common: Vec<u16> = (0u16..20).filter(|v| a.contains(*v) && b.contains(*v)).collect();
            match (ab, ba) {
                (Ok(x), Ok(y)) => {
                    prop_assert_eq!(x.version, y.version);
                    prop_assert_eq!(x.features, y.features);
                    prop_assert_eq!(Some(&x.version), common.iter().max());
                    prop_assert!(x.features.is_subset(fa) && x.features.is_subset(fb));
                    for f in Feature::ALL {
                        prop_assert_eq!(x.features.contains(f), fa.contains(f) && fb.contains(f));
                    }
                }
                (Err(x), Err(y)) => {
                    prop_assert_eq!(x, y);
                    prop_assert!(common.is_empty());
                }
                (x, y) => prop_assert!(false, "asymmetric: {:?} / {:?}", x, y),
            }
        }
    }
}
