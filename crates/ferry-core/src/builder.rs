//! The builder every configuration struct gets (`TcpConfig::builder()`…).

/// Defines `$builder`, a builder of `$config` (which must implement
/// `Default` and have `fn validate(&self) -> Result<()>`), and
/// `$config::builder()`. One setter per listed field, named after it, in
/// one of three forms:
///
/// - `set field: T` — `fn field(self, value: T)`;
/// - `into field: T` — `fn field(self, value: impl Into<T>)` (`String`,
///   `PathBuf`: pass a `&str`);
/// - `some field: T` — the field is `Option<T>`: `fn field(self, value:
///   impl Into<T>)` sets `Some`.
///
/// `build()` validates and returns the configuration. Not public API:
/// Ferry's crates use it for their configuration types.
#[doc(hidden)]
#[macro_export]
macro_rules! __config_builder {
    (
        $(#[$meta:meta])*
        $vis:vis struct $builder:ident for $config:ident {
            $( $kind:ident $field:ident : $ty:ty ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, Default)]
        #[must_use = "a builder does nothing until `build()`"]
        $vis struct $builder {
            config: $config,
        }

        impl $config {
            #[doc = concat!(
                "A builder starting from [`", stringify!($config), "::default`]; `build()` ",
                "validates (as [`", stringify!($config), "::validate`] does)."
            )]
            pub fn builder() -> $builder {
                $builder { config: <$config as ::core::default::Default>::default() }
            }
        }

        impl $builder {
            $( $crate::__config_builder!(@setter $config $kind $field $ty); )*

            #[doc = concat!(
                "The configuration, if [`", stringify!($config), "::validate`] accepts it ",
                "(`Error::InvalidArgument` naming the field otherwise)."
            )]
            pub fn build(self) -> $crate::Result<$config> {
                self.config.validate()?;
                Ok(self.config)
            }
        }
    };
    (@setter $config:ident set $field:ident $ty:ty) => {
        #[doc = concat!("Sets [`", stringify!($config), "::", stringify!($field), "`].")]
        pub fn $field(mut self, value: $ty) -> Self {
            self.config.$field = value;
            self
        }
    };
    (@setter $config:ident into $field:ident $ty:ty) => {
        #[doc = concat!("Sets [`", stringify!($config), "::", stringify!($field), "`].")]
        pub fn $field(mut self, value: impl ::core::convert::Into<$ty>) -> Self {
            self.config.$field = value.into();
            self
        }
    };
    (@setter $config:ident some $field:ident $ty:ty) => {
        #[doc = concat!(
            "Sets [`", stringify!($config), "::", stringify!($field), "`] to `Some(value)`."
        )]
        pub fn $field(mut self, value: impl ::core::convert::Into<$ty>) -> Self {
            self.config.$field = ::core::option::Option::Some(value.into());
            self
        }
    };
}
